"""Errors on the Anthropic Messages paths in Anthropic's shape, whoever made them.

The Messages routes answer their own errors as Anthropic does (gateway/http/messages.py);
what answers before them, in OpenAI's shape (the API key check's 401, the rate limiter's
429, starlette's 404 and 405), is rewritten here on `/v1/messages*` paths:
`{"error": {"message", "type", ...}}` -> `{"type": "error", "error": {"type", "message"}}`,
the type following the status as Anthropic's does. Status and headers stay.
"""

from __future__ import annotations

import json

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from zeroserve.gateway.api.anthropic_events import error_type

MESSAGES_PATH = "/v1/messages"


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def to_anthropic(body: bytes, status: int) -> bytes | None:
    """An OpenAI error body in Anthropic's shape; None if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    error = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(error, dict) or obj.get("type") == "error":
        return None
    message = error.get("message")
    return json.dumps({"type": "error", "error": {
        "type": error_type(status),
        "message": message if isinstance(message, str) else "Error."}}).encode()


class AnthropicErrorShape:
    """ASGI middleware: JSON error responses on the Messages paths in Anthropic's shape."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        held: Message | None = None  # an error's response start, until its body is read
        chunks: list[bytes] = []

        async def send_shaped(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] >= 400 \
                    and MutableHeaders(raw=message["headers"]).get(
                        "content-type", "").startswith("application/json"):
                held = message
                return
            if held is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            shaped = to_anthropic(body, held["status"])
            if shaped is not None:
                body = shaped
                headers = MutableHeaders(raw=list(held["headers"]))
                headers["content-length"] = str(len(body))
                held = {**held, "headers": headers.raw}
            await send(held)
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, send_shaped)
