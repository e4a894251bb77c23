"""Run the gateway: uvicorn on one asyncio loop, blocking until shutdown.

uvicorn binds the listening sockets; once it has started, the gateway takes them over
(BatchAcceptor): every connection waiting to be accepted is accepted each time the socket
is readable. uvloop's server accepts one connection per pass of the event loop (libuv
1.52), and a pass is long while a burst of requests is admitted and tokens relayed: of 1,000
clients that connected at once, the last waited in the kernel's accept queue for 1,000
passes (0.4-1.9 s in the relay benchmark, the burst's whole ramp).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import socket
import sys
from collections.abc import Callable

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
# Accepts per readiness of a listening socket, at most: the loop's other work waits that long.
MAX_ACCEPTS_PER_WAKE = 2048  # uvicorn's listen backlog
# After the process ran out of file descriptors (or memory) accepting: a pause, then again.
ACCEPT_RETRY_S = 1.0
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class BatchAcceptor:
    """Accepts every connection waiting on a listening socket when it is readable, and hands
    each to `protocol_factory`'s protocol through the loop (connect_accepted_socket), as the
    loop's own server would, one at a time."""

    def __init__(self, sock: socket.socket, protocol_factory: Callable[[], asyncio.Protocol],
                 loop: asyncio.AbstractEventLoop):
        sock.setblocking(False)
        self._sock, self._protocol_factory, self._loop = sock, protocol_factory, loop
        self._adopting: set[asyncio.Task] = set()  # connections being handed over
        self._retry: asyncio.TimerHandle | None = None
        self._is_closed = False
        loop.add_reader(sock.fileno(), self._accept_all)

    def _accept_all(self) -> None:
        for _ in range(MAX_ACCEPTS_PER_WAKE):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client gave up while it waited
            except OSError as e:
                if e.errno not in _OUT_OF_RESOURCES:
                    raise
                # What asyncio's server does: stop accepting for a while (the clients wait
                # in the kernel's queue), so the loop does not spin on a readable socket.
                log.error("cannot accept connections (%s); trying again in %.0fs",
                          e.strerror, ACCEPT_RETRY_S)
                self._loop.remove_reader(self._sock.fileno())
                self._retry = self._loop.call_later(ACCEPT_RETRY_S, self._resume)
                return
            task = self._loop.create_task(
                self._loop.connect_accepted_socket(self._protocol_factory, conn))
            self._adopting.add(task)
            task.add_done_callback(functools.partial(self._adopted, conn))

    def _adopted(self, conn: socket.socket, task: asyncio.Task) -> None:
        self._adopting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("dropped an accepted connection: %r", task.exception())
            conn.close()

    def _resume(self) -> None:
        self._retry = None
        if not self._is_closed:
            self._loop.add_reader(self._sock.fileno(), self._accept_all)
            self._accept_all()

    def close(self) -> None:
        """Accept no more; the connections accepted so far are the server's."""
        if self._is_closed:
            return
        self._is_closed = True
        if self._retry is not None:
            self._retry.cancel()
        else:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()


def take_over_listeners(servers: list[asyncio.AbstractServer],
                        protocol_factory: Callable[[], asyncio.Protocol],
                        loop: asyncio.AbstractEventLoop) -> list[BatchAcceptor]:
    """A BatchAcceptor on each listening socket of `servers`, which stop serving: each
    socket stays open (and listening) as the acceptor's duplicate of it."""
    acceptors = []
    for server in servers:
        listening = [socket.socket(fileno=os.dup(sock.fileno())) for sock in server.sockets]
        server.close()
        acceptors += [BatchAcceptor(sock, protocol_factory, loop) for sock in listening]
    return acceptors


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
        self.acceptors: list[BatchAcceptor] = []

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        if self.profile is not None:
            self.profile.start()
        try:
            super().run(sockets)
        finally:
            if self.profile is not None:
                self.profile.stop()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit and self.config.ssl is None:
            # The protocol uvicorn's own servers make (its startup's create_protocol).
            config = self.config
            protocol_factory = functools.partial(
                config.http_protocol_class, config=config, server_state=self.server_state,
                app_state=self.lifespan.state)
            self.acceptors = take_over_listeners(self.servers, protocol_factory,
                                                 asyncio.get_running_loop())

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for acceptor in self.acceptors:  # no new connections (uvicorn's servers are closed)
            acceptor.close()
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
