"""Run the gateway: uvicorn on one asyncio loop, blocking until shutdown."""

from __future__ import annotations

import asyncio
import socket
import sys

import uvicorn
from starlette.applications import Starlette

from zeroserve.common.gc_tuning import tune_for_serving
from zeroserve.gateway.app import build_app
from zeroserve.gateway.config import GatewayConfig
from zeroserve.gateway.core import Gateway
from zeroserve.gateway.http.http_protocol import DEFAULT_MAX_HEAD_BYTES, guarded_protocol
from zeroserve.gateway.logging import get_logger, setup_logging
from zeroserve.gateway.observability.cpu_profile import CpuProfile

STARTUP_FAILURE = 3
log = get_logger("server")


def bind_shared(host: str, port: int) -> socket.socket:
    """A listening TCP socket with SO_REUSEPORT: every gateway process of one `serve` binds
    the same port this way, and the kernel spreads new connections over the live ones (a
    dead one's share goes to the others)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def uvicorn_config(app: Starlette, config: GatewayConfig, **overrides) -> uvicorn.Config:
    """uvicorn's settings for the gateway: a deadline and a size cap for request heads (our
    protocol class), and h11's head buffer bounded as well, should h11 ever be chosen."""
    # log_config=None: uvicorn's own loggers propagate to our root handler, so with
    # --log-format json its lines are JSON too.
    settings = dict(host=config.host, port=config.port, log_level=config.log_level,
                    log_config=None, access_log=False,
                    timeout_graceful_shutdown=config.shutdown_timeout_s,
                    lifespan="on", http=guarded_protocol(config.header_timeout_s,
                                                         config.client_send_buffer_bytes),
                    h11_max_incomplete_event_size=DEFAULT_MAX_HEAD_BYTES)
    settings.update(overrides)
    return uvicorn.Config(app, **settings)


class GatewayHttpServer(uvicorn.Server):
    """uvicorn's server with the gateway's end to a shutdown. uvicorn waits up to
    timeout_graceful_shutdown for responses to end, then cancels their tasks: a request
    still waiting for a worker got a plain-text 500, and a stream a cut connection with no
    error event. Here, as the shutdown starts, waiting and new requests get a 503 at once;
    streams still running shortly before the deadline end with an error event and [DONE]."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway,
                 profile: CpuProfile | None = None):
        super().__init__(config)
        self.gateway = gateway
        self.profile = profile  # ZEROSERVE_GATEWAY_CPU_PROFILE: written at shutdown

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        if self.profile is not None:
            self.profile.start()
        try:
            super().run(sockets)
        finally:
            if self.profile is not None:
                self.profile.stop()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.gateway.begin_shutdown()
        grace_s = self.config.timeout_graceful_shutdown or 0.0
        # The last second (at most half the grace) is for the error events to go out.
        end = asyncio.get_running_loop().call_later(grace_s - min(1.0, grace_s / 2),
                                                    self.gateway.end_requests)
        try:
            await super().shutdown(sockets)
        finally:
            end.cancel()
            if self.profile is not None:
                self.profile.stop()


def run_gateway(config: GatewayConfig) -> None:
    setup_logging(config.log_format, config.log_level)
    app = build_app(config)
    server = GatewayHttpServer(uvicorn_config(app, config), app.state.gateway,
                               CpuProfile.from_env(config.gateway_index))
    sockets = None
    if config.reuse_port:
        try:
            sockets = [bind_shared(config.host, config.port)]
        except OSError as e:
            log.error("cannot bind %s:%d: %s", config.host, config.port, e)
            sys.exit(STARTUP_FAILURE)
    tune_for_serving()  # the app (tokenizer, template, routes) is built: freeze it
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:
        pass
    if not server.started:  # as uvicorn.run: a failed start (port in use) is exit 3
        sys.exit(STARTUP_FAILURE)
