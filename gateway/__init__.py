"""The HTTP gateway: OpenAI-compatible API in front of ZeroMQ workers."""
