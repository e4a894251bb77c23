"""The starlette application: routes, and the gateway's start/stop around its lifetime."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from zeroserve.common.model_files import model_display_name
from zeroserve.gateway.config import GatewayConfig, parse_model_spec
from zeroserve.gateway.core import Gateway
from zeroserve.gateway.errors import APIError, invalid_api_key, server_error
from zeroserve.gateway.http.admin import AdminApi
from zeroserve.gateway.http.anthropic_errors import AnthropicErrorShape
from zeroserve.gateway.http.auth import ApiKeyMiddleware, ApiKeys, warn_if_exposed
from zeroserve.gateway.http.debug import DebugApi
from zeroserve.gateway.http.direct_routes import DirectRoutes
from zeroserve.gateway.http.early_shed import EarlyShedMiddleware
from zeroserve.gateway.http.error_response import error_response
from zeroserve.gateway.http.health import HealthEndpoints
from zeroserve.gateway.http.host_check import AllowedHosts, HostCheckMiddleware
from zeroserve.gateway.http.messages import MessagesApi
from zeroserve.gateway.http.rate_limit import RateLimiter, RateLimitMiddleware
from zeroserve.gateway.http.responses_routes import ResponsesApi
from zeroserve.gateway.http.routes import Api
from zeroserve.gateway.http.ui import ConsolePages
from zeroserve.gateway.key_limits import default_limits, load_key_limits, load_model_limits
from zeroserve.gateway.logging import get_logger
from zeroserve.gateway.observability.loop_monitor import LoopLagMonitor
from zeroserve.gateway.observability.metrics import DEFAULT_MAX_MODEL_LEN, Metrics, NoRequestMetrics
from zeroserve.gateway.observability.tier_metrics import TierMetrics
from zeroserve.gateway.observability.tracing import RequestTracer
from zeroserve.gateway.text.chat_template import ChatTemplate
from zeroserve.gateway.text.model_texts import load_model_text
from zeroserve.gateway.text.tokenizer import TextTokenizer, load_tokenizer
from zeroserve.gateway.workers.alias_file import AliasFile
from zeroserve.gateway.workers.models import ModelCatalog, parse_alias

log = get_logger("app")


def served_model_names(config: GatewayConfig) -> tuple[str, ...]:
    """Names a request may use for `model`; the first is the one /v1/models lists."""
    display = model_display_name(config.model)
    names = [config.served_model_name or display, display]
    return tuple(dict.fromkeys(names))


def extra_model_paths(config: GatewayConfig, names: tuple[str, ...]) -> dict[str, str]:
    """`--add-model`'s served names -> their files (a name's first spec wins: its versions
    share its tokenizer; one of the default model's `names` is another version of it)."""
    paths: dict[str, str] = {}
    for spec in config.extra_models:
        name, _, path, _ = parse_model_spec(spec)
        if name not in names:
            paths.setdefault(name, path)
    return paths


def model_catalog(config: GatewayConfig, names: tuple[str, ...]) -> ModelCatalog:
    """The models served (the default one under `names`), its aliases, the tier's file."""
    table = {name: names[0] for name in names}
    for name in extra_model_paths(config, names):
        table[name] = name
    shared = None if config.aliases_file is None else AliasFile(config.aliases_file)
    return ModelCatalog(names[0], table, [parse_alias(a) for a in config.model_aliases],
                        shared)


def build_app(config: GatewayConfig, tokenizer: TextTokenizer | None = None,
              tokenizers: dict[str, TextTokenizer] | None = None) -> Starlette:
    """Load the tokenizers now (once); bind the sockets when the server starts.
    `tokenizer`, `tokenizers` (by served name, for `extra_models`): ones already loaded."""
    tokenizer = tokenizer or load_tokenizer(config.model)
    if tokenizer.is_byte_level:
        tokenizer.shown_bytes_table()  # built now (with bytes_table), not on a request
    template = ChatTemplate.from_tokenizer(tokenizer, config.chat_template)
    names = served_model_names(config)
    models = model_catalog(config, names)
    others = tuple(load_model_text(name, path, (tokenizers or {}).get(name))
                   for name, path in extra_model_paths(config, names).items())
    tier = None if config.metrics_dir is None or config.disable_metrics else TierMetrics(
        config.metrics_dir, config.gateway_index)
    metrics = None if config.disable_metrics else Metrics(
        names[0], tokenizer.max_model_len or DEFAULT_MAX_MODEL_LEN, tier)
    tracer = None if config.otlp_traces_endpoint is None else RequestTracer.for_endpoint(
        config.otlp_traces_endpoint, names[0])
    gateway = Gateway(config, metrics=NoRequestMetrics() if metrics is None else metrics.requests,
                      tracer=tracer, models=models)
    api = Api(config, gateway, tokenizer, template, names, others)
    messages = MessagesApi(api)
    loop_monitor = LoopLagMonitor(warn_s=config.loop_lag_warn_s)
    if metrics is not None:
        metrics.watch(gateway, loop_monitor)
    keys = ApiKeys(config.api_keys)
    health = HealthEndpoints(gateway, loop_monitor, keys)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop_monitor.start()
        await gateway.start()
        snapshots = None if tier is None else asyncio.create_task(
            metrics.write_tier_snapshots(), name="tier-metrics")
        warn_if_exposed(config.host, keys)
        log.info("gateway started", extra={"model": api.served_names[0],
                                           "models": list(models.served),
                                           "aliases": sorted(models.aliases),
                                           "router": gateway.edge.router_address,
                                           "tokens": gateway.edge.tokens_address})
        try:
            yield
        finally:
            if snapshots is not None:
                snapshots.cancel()
            await gateway.stop()
            await loop_monitor.stop()
            if tracer is not None:  # flushes queued spans (bounded by the export timeout)
                await asyncio.get_running_loop().run_in_executor(None, tracer.shutdown)
            log.info("gateway stopped")

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(server_error("Internal server error."))

    admin = AdminApi(config, gateway)
    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        *ResponsesApi(api).routes(),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/v1/messages", messages.create, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        *health.routes(),
        *([] if metrics is None else [
            Route("/metrics", metrics_endpoint(metrics, keys), methods=["GET"])]),
        *admin.routes(),
        *DebugApi(admin, gateway).routes(),
        *([] if config.disable_ui else ConsolePages().routes()),
    ]
    # Innermost: the generation routes' short way past Starlette's router (same handlers).
    direct = Middleware(DirectRoutes, routes={"/v1/completions": api.completions,
                                              "/v1/chat/completions": api.chat},
                        on_http_error=http_error)
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[*http_middleware(config, keys, metrics, gateway), direct],
                    exception_handlers={HTTPException: http_error, Exception: unexpected_error})
    app.state.gateway = gateway
    app.state.api = api
    return app


def metrics_endpoint(metrics: Metrics, keys: ApiKeys):
    """GET /metrics. With API keys set it needs one (Prometheus sends it with
    `authorization: {credentials: KEY}`): it names workers and their load. It is not rate
    limited, so scrapes never crowd out requests."""

    async def scrape(request: Request) -> Response:
        if not keys.is_authorized(request):
            return error_response(invalid_api_key())
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    return scrape


def http_middleware(config: GatewayConfig, keys: ApiKeys, metrics: Metrics | None = None,
                    gateway: Gateway | None = None) -> list[Middleware]:
    """Outermost first: Anthropic's error shape on /v1/messages* (for the errors of all the
    others), the Host check, CORS (so preflights and 401s carry its headers), the API key,
    the rate limiter (which needs to know the key), then the lowest class's 429 before the
    body is read (gateway/http/early_shed.py)."""
    stack = [Middleware(AnthropicErrorShape)]  # outside the key check and rate limiter
    hosts = AllowedHosts.for_server(config.host, config.allowed_hosts)
    if hosts is not None:  # gateway/http/host_check.py: DNS rebinding
        stack.append(Middleware(HostCheckMiddleware, hosts=hosts))
    if config.allowed_origins:
        # Bearer keys, not cookies: no credentials mode. Browsers may read Retry-After.
        stack.append(Middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                                allow_methods=["GET", "POST"], allow_headers=["*"],
                                expose_headers=["Retry-After"], max_age=600))
    if keys.is_enabled:
        stack.append(Middleware(ApiKeyMiddleware, keys=keys))
    default = default_limits(config.rate_limit_rps, config.rate_limit_burst,
                             config.rate_limit_tpm)
    limiter = RateLimiter(default, load_key_limits(config.rate_limits_file, config.api_keys,
                                                   default))
    limiter.limit_models(load_model_limits(config.rate_limits_file))
    if limiter.is_enabled:
        stack.append(Middleware(RateLimitMiddleware, limiter=limiter,
                                on_refused=None if metrics is None else metrics.requests.on_refused))
    if gateway is not None:
        stack.append(Middleware(EarlyShedMiddleware, gateway=gateway))
    return stack
