"""Run the gateway: uvicorn on one asyncio loop, blocking until shutdown."""

from __future__ import annotations

import uvicorn

from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.logging import setup_logging


def run_gateway(config: GatewayConfig) -> None:
    setup_logging(config.log_format, config.log_level)
    app = build_app(config)
    # log_config=None: uvicorn's own loggers propagate to our root handler, so with
    # --log-format json its lines are JSON too.
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level,
                log_config=None, access_log=False, timeout_graceful_shutdown=5,
                lifespan="on")
