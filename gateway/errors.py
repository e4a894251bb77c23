"""Typed errors that become OpenAI-shaped JSON responses.

Every failure a client can see is an `APIError`: the caller's mistakes are 4xx
(`invalid_request_error`), capacity and worker trouble are 429/503, and only genuine
server faults are 500. Body: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def body_too_large(limit_bytes: int) -> APIError:
    # Connection: close, since the rest of the body is not read.
    return APIError(413, f"The request body is larger than the limit of {limit_bytes} bytes.",
                    code="request_too_large", headers={"Connection": "close"})


def body_timeout(timeout_s: float) -> APIError:
    return APIError(408, f"The request body did not arrive within {timeout_s:g}s.",
                    type="timeout_error", code="request_body_timeout",
                    headers={"Connection": "close"})


def unsupported_media_type(content_type: str) -> APIError:
    return APIError(415, f"The request body must be JSON with 'Content-Type: application/json'"
                         f", got {content_type[:100]!r}.", code="unsupported_media_type")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model",
                    code="model_not_found")


def queue_full(retry_after_s: int) -> APIError:
    return APIError(429, "The server is at capacity: too many requests are queued. "
                         "Retry later.", type="rate_limit_error", code="queue_full",
                    headers={"Retry-After": str(retry_after_s)})


def invalid_api_key() -> APIError:
    # OpenAI's shape for a missing or wrong key; the message never repeats what was sent.
    return APIError(401, "Invalid or missing API key: send 'Authorization: Bearer KEY' with "
                         "one of the server's API keys.", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def rate_limited(message: str, retry_after_s: int) -> APIError:
    return APIError(429, message, type="rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(retry_after_s)})


def no_worker(message: str = "No worker is available to serve the request.") -> APIError:
    return APIError(503, message, type="service_unavailable", code="no_worker",
                    headers={"Retry-After": "1"})


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down.", type="service_unavailable",
                    code="shutdown", headers={"Retry-After": "1"})


def worker_failed(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="worker_lost")


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def client_too_slow(timeout_s: float) -> APIError:
    return APIError(408, f"The client read too slowly for {timeout_s:g}s (nothing at all, or "
                         "below the server's minimum rate); the stream was aborted.",
                    type="timeout_error", code="slow_client")


def request_timeout(message: str) -> APIError:
    """The server gave up waiting on its worker (a 504, as a proxy whose upstream idled)."""
    return APIError(504, message, type="timeout_error", code="request_timeout")
