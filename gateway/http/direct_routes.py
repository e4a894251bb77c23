"""The generation routes' short way in: POST /v1/completions and /v1/chat/completions go
straight from the innermost middleware to their handlers.

Starlette would take each of them through its exception middleware, the router (matching
the path against the routes in turn), the route's request_response wrapper and a wrapper
around `send` per message. At 1,000 requests arriving at once (issue 36) those layers were
a tenth of the gateway's CPU per admitted request, for a path and method known at once.

What a request sees is the same: the middlewares outside this one (Host check, CORS, API
key, rate limit, early shed) ran as before; the handler gets the same Request; an
HTTPException it raises gets the app's handler for it, as Starlette's exception middleware
would give it; any other exception goes up to Starlette's ServerErrorMiddleware as before
(a 500 in OpenAI's shape). Anything else (another path or method, a `root_path` for the
router to strip) goes on to Starlette's router.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

Handler = Callable[[Request], Awaitable[Response]]
HttpErrorHandler = Callable[[Request, HTTPException], Awaitable[Response]]


class DirectRoutes:
    """Innermost middleware: `routes` (path -> handler of POST) answered directly."""

    def __init__(self, app: ASGIApp, routes: Mapping[str, Handler],
                 on_http_error: HttpErrorHandler) -> None:
        self.app = app
        self.routes = dict(routes)
        self.on_http_error = on_http_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = None
        if scope["type"] == "http" and scope["method"] == "POST" \
                and not scope.get("root_path"):
            handler = self.routes.get(scope["path"])
        if handler is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except HTTPException as exc:
            response = await self.on_http_error(request, exc)
        await response(scope, receive, send)
        # (The protocol's entries in the scope, which close a reference cycle, are taken out
        # by the protocol itself when the app returns: gateway/http/http_protocol.py.)
