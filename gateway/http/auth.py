"""API keys for the HTTP API, as vLLM's `--api-key`.

- With keys configured, every `/v1/*` call and `/tokenize`, `/detokenize` need
  `Authorization: Bearer KEY` (or `x-api-key: KEY`, as Anthropic's clients send it); a
  missing or wrong key is 401 in OpenAI's shape, with `WWW-Authenticate: Bearer`. OPTIONS
  passes (a CORS preflight carries no credentials and can do nothing), as in vLLM.
- Liveness and readiness stay open; callers without a valid key get only what a probe needs
  (`gateway/http/health.py` asks `is_authorized`): no pids, worker ids, devices or model files.
- Keys are compared in constant time: the presented token is hashed (so its length tells
  nothing) and its digest compared with every key's, with no early exit on a match.
- The admin API (`gateway/http/admin.py`) has its own check: admin keys only, never these.

The middleware records which key matched (its index) in the request's state for the rate
limiter (`gateway/http/rate_limit.py`), so a key is matched once per request.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from zeroserve.common.logging_setup import RateLimited, printable
from zeroserve.gateway.errors import invalid_api_key
from zeroserve.gateway.http.error_response import error_response
from zeroserve.gateway.logging import get_logger

log = get_logger("auth")

PROTECTED_PATHS = frozenset({"/v1", "/tokenize", "/detokenize"})
KEY_INDEX_STATE = "api_key_index"  # request.state attribute: which key matched


def is_protected(path: str) -> bool:
    """Paths that need a key (and count against rate limits): the OpenAI API and vLLM's
    tokenizer endpoints; unknown /v1/ paths too, so a caller without a key learns nothing."""
    return path.startswith("/v1/") or path in PROTECTED_PATHS


class ApiKeys:
    """The configured keys, held as SHA-256 digests."""

    def __init__(self, keys: tuple[str, ...]):
        self._digests = tuple(hashlib.sha256(key.encode()).digest() for key in keys)

    @property
    def is_enabled(self) -> bool:
        return bool(self._digests)

    def match(self, authorization: str | None) -> int | None:
        """The index of the key an Authorization header carries; None if none matches."""
        scheme, _, token = (authorization or "").partition(" ")
        digest = hashlib.sha256(token.strip().encode()).digest()
        found = None
        for index, key in enumerate(self._digests):  # every key, whichever matches
            if hmac.compare_digest(digest, key):
                found = index
        return found if scheme.lower() == "bearer" else None

    def is_authorized(self, request: Request) -> bool:
        """True when no keys are configured or the request carries one of them."""
        return not self.is_enabled or self.match(presented_key(request.headers)) is not None


def presented_key(headers: Headers) -> str | None:
    """The credentials a request presents, as an Authorization header value:
    `Authorization: Bearer KEY`, else Anthropic's `x-api-key: KEY` (the anthropic SDK and
    Claude Code send that one)."""
    authorization = headers.get("authorization")
    api_key = headers.get("x-api-key")
    if authorization is None and api_key is not None:
        return "Bearer " + api_key
    return authorization


class ApiKeyMiddleware:
    """ASGI middleware: 401 for protected paths without a valid key."""

    def __init__(self, app: ASGIApp, keys: ApiKeys):
        self.app = app
        self.keys = keys
        self._warn = RateLimited()  # a flood of bad keys must not flood the log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] == "OPTIONS"
                or not is_protected(scope["path"])):
            await self.app(scope, receive, send)
            return
        index = self.keys.match(presented_key(Headers(scope=scope)))
        if index is None:
            num_held = self._warn.allow("invalid_api_key")
            if num_held is not None:
                log.info("refused a request without a valid API key",
                         extra={"path": printable(scope["path"]), "client": _client_host(scope),
                                "num_refused_since_last_line": num_held})
            await error_response(invalid_api_key())(scope, receive, send)
            return
        scope.setdefault("state", {})[KEY_INDEX_STATE] = index
        await self.app(scope, receive, send)


def key_index(scope: Scope) -> int | None:
    """The index of the API key this request was authorized with (None: no keys)."""
    return scope.get("state", {}).get(KEY_INDEX_STATE)


def _client_host(scope: Scope) -> Any:
    client = scope.get("client")
    return client[0] if client else None


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost, or "" (all interfaces)


def warn_if_exposed(host: str, keys: ApiKeys) -> None:
    """A gateway reachable from other machines with no API key serves anyone who finds it."""
    if keys.is_enabled or is_loopback_host(host):
        return
    log.warning(
        "SECURITY WARNING: the gateway listens on %s, which is not a loopback address, and no "
        "API key is set: anyone who can reach this port can use it. Set --api-key (or "
        "ZEROSERVE_API_KEY), or bind --host 127.0.0.1.", host)
