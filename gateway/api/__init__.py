"""The meaning of the OpenAI API, no I/O: request schemas and their validation, response bodies
and chunks, tool calls, structured output, request limits. Knows nothing of starlette."""
