"""Which `Host` names the gateway answers to: the defence against DNS rebinding.

A web page on a name its owner controls can make that name resolve to 127.0.0.1: the
browser then sends the page's requests to a gateway on this machine and lets the page read
the replies (same origin, as far as the browser knows), with `Host: that-name`. So:

- a gateway bound to a loopback address (`--host 127.0.0.1`, the default, `localhost`,
  `::1`) answers only loopback names by default: `localhost`, `127.0.0.1` (any 127.x),
  `[::1]`, with any port. This holds for every route, not only the admin API: through a
  rebound name a page would read completions, `/health` and `/metrics` too;
- `--allowed-hosts` adds names (`api.example.com`, `*.example.com`, `[::1]`, or `*` for
  any); loopback names always pass, so local probes (serve's supervisor, `zeroserve check`)
  keep working;
- a gateway bound to any other address with no `--allowed-hosts` answers any name (as
  before: it is meant to be reached by names this process cannot know).

A refused request gets 421 (Misdirected Request) in OpenAI's error shape. A request with no
Host header passes: a browser always sends one.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from zeroserve.gateway.errors import APIError
from zeroserve.gateway.http.auth import is_loopback_host
from zeroserve.gateway.http.error_response import error_response

_MAX_KNOWN_HOSTS = 256


def host_name(value: str) -> str:
    """The name in a Host header or an --allowed-hosts entry, without its port or the
    brackets of an IPv6 literal, lowercased: "[::1]:8000" -> "::1", "API.example:443" ->
    "api.example"."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else value  # malformed: matches no allowed name
    if value.count(":") == 1:  # name:port; two or more colons: a bare IPv6 literal
        value = value.partition(":")[0]
    return value.rstrip(".")


class AllowedHosts:
    """The names a gateway answers to; `None` from `for_server` means any."""

    def __init__(self, patterns: tuple[str, ...]):
        self.names = frozenset(host_name(p) for p in patterns if not p.startswith("*."))
        self.suffixes = tuple(host_name(p)[1:] for p in patterns if p.startswith("*."))
        self._known: dict[str, bool] = {}  # Host header -> allowed

    @classmethod
    def for_server(cls, bind_host: str, allowed_hosts: tuple[str, ...]) -> AllowedHosts | None:
        if "*" in allowed_hosts or (not allowed_hosts and not is_loopback_host(bind_host)):
            return None
        return cls(allowed_hosts)

    def allows(self, host_header: str) -> bool:
        """Memoized (a few names come again and again; parsing an IP literal costs
        microseconds per request), in a table bounded against a client sending many."""
        known = self._known.get(host_header)
        if known is None:
            if len(self._known) >= _MAX_KNOWN_HOSTS:
                self._known.clear()
            known = self._known[host_header] = self._allows(host_header)
        return known

    def _allows(self, host_header: str) -> bool:
        name = host_name(host_header)
        return (is_loopback_host(name) or name in self.names
                or any(name.endswith(suffix) for suffix in self.suffixes))


def host_header(scope: Scope) -> str | None:
    """The request's first Host header, as starlette's Headers(scope=scope).get("host")
    reads it (the server gives header names in lower case), without building the Headers
    and its list: once per request, in front of every route."""
    for name, value in scope["headers"]:
        if name == b"host":
            return value.decode("latin-1")
    return None


def host_not_allowed(host_header: str) -> APIError:
    return APIError(421, f"This server does not answer to the host name "
                         f"{host_header[:100]!r}; use localhost, or list the name in "
                         "--allowed-hosts.", code="host_not_allowed")


class HostCheckMiddleware:
    """ASGI middleware: 421 for an HTTP request whose Host is not allowed."""

    def __init__(self, app: ASGIApp, hosts: AllowedHosts):
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = host_header(scope)
            if host is not None and not self.hosts.allows(host):
                await error_response(host_not_allowed(host))(scope, receive, send)
                return
        await self.app(scope, receive, send)
