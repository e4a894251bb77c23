"""HTTP: the only layer where starlette and uvicorn live. Routes, SSE streaming, request bodies,
the guarded uvicorn protocol, API keys, rate limits, health and the admin API."""
