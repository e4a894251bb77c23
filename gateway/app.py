"""The starlette application: routes, and the gateway's start/stop around its lifetime."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from common.model_files import model_display_name
from gateway.admin import AdminApi
from gateway.chat_template import ChatTemplate
from gateway.config import GatewayConfig
from gateway.core import Gateway
from gateway.errors import APIError, server_error
from gateway.health import HealthEndpoints
from gateway.logging import get_logger
from gateway.loop_monitor import LoopLagMonitor
from gateway.routes import Api
from gateway.tokenizer import TextTokenizer, load_tokenizer

log = get_logger("app")


def served_model_names(config: GatewayConfig) -> tuple[str, ...]:
    """Names a request may use for `model`; the first is the one /v1/models lists."""
    display = model_display_name(config.model)
    names = [config.served_model_name or display, display]
    return tuple(dict.fromkeys(names))


def build_app(config: GatewayConfig, tokenizer: TextTokenizer | None = None) -> Starlette:
    """Load the tokenizer now (once); bind the sockets when the server starts."""
    tokenizer = tokenizer or load_tokenizer(config.model)
    if tokenizer.is_byte_level:
        tokenizer.bytes_table()  # built now, not on the first request
    template = ChatTemplate.from_tokenizer(tokenizer)
    gateway = Gateway(config)
    api = Api(config, gateway, tokenizer, template, served_model_names(config))
    loop_monitor = LoopLagMonitor(warn_s=config.loop_lag_warn_s)
    health = HealthEndpoints(gateway, loop_monitor)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop_monitor.start()
        await gateway.start()
        log.info("gateway started", extra={"model": api.served_names[0],
                                           "router": gateway.edge.router_address,
                                           "tokens": gateway.edge.tokens_address})
        try:
            yield
        finally:
            await gateway.stop()
            await loop_monitor.stop()
            log.info("gateway stopped")

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return server_error("Internal server error.").response()

    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        *health.routes(),
        *AdminApi(config, gateway).routes(),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: unexpected_error})
    app.state.gateway = gateway
    app.state.api = api
    return app
