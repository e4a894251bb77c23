"""Run the gateway: uvicorn on one asyncio loop, blocking until shutdown."""

from __future__ import annotations

import sys

import uvicorn
from starlette.applications import Starlette

from common.gc_tuning import tune_for_serving
from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.http_protocol import DEFAULT_MAX_HEAD_BYTES, guarded_protocol
from gateway.logging import setup_logging

STARTUP_FAILURE = 3


def uvicorn_config(app: Starlette, config: GatewayConfig, **overrides) -> uvicorn.Config:
    """uvicorn's settings for the gateway: a deadline and a size cap for request heads (our
    protocol class), and h11's head buffer bounded as well, should h11 ever be chosen."""
    # log_config=None: uvicorn's own loggers propagate to our root handler, so with
    # --log-format json its lines are JSON too.
    settings = dict(host=config.host, port=config.port, log_level=config.log_level,
                    log_config=None, access_log=False, timeout_graceful_shutdown=5,
                    lifespan="on", http=guarded_protocol(config.header_timeout_s),
                    h11_max_incomplete_event_size=DEFAULT_MAX_HEAD_BYTES)
    settings.update(overrides)
    return uvicorn.Config(app, **settings)


def run_gateway(config: GatewayConfig) -> None:
    setup_logging(config.log_format, config.log_level)
    server = uvicorn.Server(uvicorn_config(build_app(config), config))
    tune_for_serving()  # the app (tokenizer, template, routes) is built: freeze it
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if not server.started:  # as uvicorn.run: a failed start (port in use) is exit 3
        sys.exit(STARTUP_FAILURE)
