"""An `APIError` as the HTTP response a client gets: OpenAI's error body with the error's status
and headers. Here rather than in gateway/errors.py, so that starlette stays in this layer."""

from __future__ import annotations

from starlette.responses import JSONResponse

from zeroserve.gateway.errors import APIError


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
