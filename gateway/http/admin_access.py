"""Who may call the admin API (gateway/http/admin.py, gateway/http/debug.py).

- With admin keys (`--admin-key`): `Authorization: Bearer KEY` with one of them, from
  anywhere (compared in constant time). API keys never grant it.
- Without admin keys, from the gateway's own machine only: a loopback peer that no proxy
  speaks for (no Forwarded, X-Forwarded-For, X-Real-IP). With API keys set, such a call
  must also carry the admin token (common/admin_token.py: a file only the user who
  runs the gateway can read; `zeroserve` commands send it by themselves as
  `X-Zeroserve-Admin-Token`, and it also passes as `Authorization: Bearer TOKEN`, for the
  console's admin key field). So another user of the machine, a container on the host
  network, or a TLS terminator that adds no forwarding header, cannot operate a gateway
  whose serving API is closed to them.
- Every keyless call, GET included, names the gateway by a loopback name (Host:
  localhost, 127.x, [::1]: a page rebound by DNS to 127.0.0.1 sends its own name) and
  carries a header a web page cannot send cross-site without a preflight
  (`Content-Type: application/json`, `X-Zeroserve-Admin`, the token, or Authorization).

And never a web page, whatever its rights (`cross_site_refusal`):
- a request with an `Origin` header is refused (403) unless that origin is named in
  `--allowed-origins` (`*` does not count: it is for the serving API) or is the gateway's
  own: the console at /ui, served by this gateway, when its Host is a loopback name or when
  admin keys are set (then the caller needs one, which another site's page does not have);
- a POST must say `Content-Type: application/json` or carry `Authorization` (415 otherwise):
  a browser sends neither cross-site without a CORS preflight;
- DNS rebinding against a loopback-bound gateway is refused before any route by the Host
  check (gateway/http/host_check.py); the Host rule above covers gateways bound elsewhere.
"""

from __future__ import annotations

import hmac
import logging

from starlette.datastructures import Headers
from starlette.requests import Request

from zeroserve.common.admin_token import TOKEN_HEADER, load_or_create_token, token_path
from zeroserve.gateway.config import GatewayConfig
from zeroserve.gateway.errors import APIError
from zeroserve.gateway.http.auth import ApiKeys, is_loopback_host
from zeroserve.gateway.http.host_check import host_name

_PROXY_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")
ADMIN_HEADER = "x-zeroserve-admin"  # the console's: any value, a page cannot send it


class AdminToken:
    """The admin token this gateway accepts: made (or read) at start, read again when a
    caller presents another one (the file may have been removed and made anew)."""

    def __init__(self, log: logging.Logger):
        self.path = token_path()
        self._log = log
        self._token = self._load()
        if self._token is not None:
            log.info("admin token in %s (zeroserve commands on this machine send it by "
                     "themselves)", self.path)

    def _load(self) -> str | None:
        try:
            return load_or_create_token(self.path)
        except OSError as e:
            self._log.error("no admin token: %s; keyless admin calls are refused where API "
                            "keys are set", e)
            return None

    def is_presented(self, headers: Headers) -> bool:
        presented = headers.get(TOKEN_HEADER)
        if presented is None:
            scheme, _, presented = (headers.get("authorization") or "").partition(" ")
            if scheme.lower() != "bearer":
                return False
        presented = presented.strip()
        if not presented:
            return False
        if self._token is not None and _same(presented, self._token):
            return True
        self._token = self._load()
        return self._token is not None and _same(presented, self._token)


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


class AdminAccess:
    def __init__(self, config: GatewayConfig, log: logging.Logger):
        self.keys = ApiKeys(config.admin_keys)
        # With admin keys, a key is needed (as ever); without, keyless calls need the
        # token wherever the serving API is closed.
        self.needs_token = bool(config.api_keys) and not self.keys.is_enabled
        self.token = AdminToken(log) if self.needs_token else None
        self.origins = frozenset(o for o in config.allowed_origins if o != "*")

    def refusal(self, request: Request) -> APIError | None:
        """Why this caller may not use an admin route; None: it may."""
        if self.keys.is_enabled:
            if self.keys.match(request.headers.get("authorization")) is None:
                return APIError(401, "A valid admin key is required (Authorization: Bearer "
                                     "KEY).", type="authentication_error",
                                code="invalid_admin_key", headers={"WWW-Authenticate": "Bearer"})
            return cross_site_refusal(request, self.origins, has_admin_keys=True)
        return (self._keyless_caller_refusal(request)
                or cross_site_refusal(request, self.origins, self.keys.is_enabled)
                or keyless_refusal(request))

    def _keyless_caller_refusal(self, request: Request) -> APIError | None:
        if not is_local_client(request):
            return APIError(403, "The admin API answers only clients on the gateway's own "
                                 "machine unless an admin key is set (--admin-key); API keys "
                                 "do not grant it.", type="permission_error",
                            code="admin_forbidden")
        if self.needs_token and not self.token.is_presented(request.headers):
            return APIError(401, f"This gateway has API keys: an admin call needs an admin key "
                                 f"(--admin-key) or the admin token of the user who runs it "
                                 f"(the file {self.token.path}, sent as {TOKEN_HEADER}; "
                                 "`zeroserve` commands on this machine send it by "
                                 "themselves).", type="authentication_error",
                            code="admin_token_required")
        return None


def is_local_client(request: Request) -> bool:
    """A loopback peer that no proxy speaks for."""
    return (request.client is not None and is_loopback_host(request.client.host)
            and not any(name in request.headers for name in _PROXY_HEADERS))


def keyless_refusal(request: Request) -> APIError | None:
    """A keyless call names the gateway by a loopback name and carries a non-simple header."""
    host = request.headers.get("host")
    if host is None or not is_loopback_host(host_name(host)):
        return APIError(403, "An admin call without an admin key must name the gateway by a "
                             "loopback name (http://127.0.0.1, localhost or [::1]).",
                        type="permission_error", code="admin_host_forbidden")
    headers = request.headers
    content_type = headers.get("content-type", "").partition(";")[0].strip().lower()
    if not (content_type == "application/json" or ADMIN_HEADER in headers
            or TOKEN_HEADER in headers or "authorization" in headers):
        return APIError(403, "An admin call without an admin key needs a header a web page "
                             "cannot send: 'Content-Type: application/json' or "
                             "'X-Zeroserve-Admin: 1' (GET included).",
                        type="permission_error", code="admin_header_required")
    return None


def _is_own_origin(request: Request, origin: str, has_admin_keys: bool) -> bool:
    """The page making the call was served by this gateway (the console), under a name no
    other site's page can have: a loopback name, or any name when a key is required."""
    host = request.headers.get("host")
    if host is None or origin != f"{request.url.scheme}://{host}":
        return False
    return has_admin_keys or is_loopback_host(host_name(host))


def cross_site_refusal(request: Request, origins: frozenset[str],
                       has_admin_keys: bool) -> APIError | None:
    """What a browser could send on a web page's behalf is refused (the module's docstring)."""
    origin = request.headers.get("origin")
    if (origin is not None and origin not in origins
            and not _is_own_origin(request, origin, has_admin_keys)):
        return APIError(403, f"The admin API does not answer web pages (Origin "
                             f"{origin[:100]!r}); call it with `zeroserve workers` or curl, or "
                             "name the origin in --allowed-origins.", type="permission_error",
                        code="cross_origin_forbidden")
    if request.method == "POST" and "authorization" not in request.headers:
        content_type = request.headers.get("content-type", "")
        if content_type.partition(";")[0].strip().lower() != "application/json":
            return APIError(415, "An admin POST needs 'Content-Type: application/json' (an "
                                 "empty body takes the defaults) or an Authorization header.",
                            code="unsupported_media_type")
    return None
