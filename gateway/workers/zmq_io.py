"""The gateway's ZeroMQ edge: it binds the sockets, runs the receive loop, sends.

- ROUTER: control both ways; frames are [route, type, body]. A worker's route (its DEALER's
  routing id) is its worker id plus a random suffix chosen per process, so it cannot be
  guessed or taken over by another peer: the gateway sends to a worker only through the
  route that its accepted HELLO came from (`bind_route`). A restarted worker comes with a
  new route.
- PULL: TOKENS from every worker's PUSH; frames are [type, body]. A PULL has no routes: a
  worker names its process in its connection's metadata (X-Incarnation), and TOKENS from a
  process other than the one bound to their worker id (a dead one's, still queued) keep
  their outputs (stale by attempt, the core drops them) but lose their `seq`, so they never
  move the new process's TOKENS sequence (gateway/reconcile.py relies on it).

With a key set (CurveZMQ) both sockets are CURVE servers: only peers whose public key is on
the allow-list complete a handshake (gateway/workers/zap.py), and every message carries the worker
id its key was issued for (`Peer.user_id`), which the core checks against what the message
claims. Without keys the sockets must be ipc:// in a private directory (or the operator said
--insecure).

Every socket has a message size limit (a bigger frame drops the connection) and bounded
queues. One receive loop polls both sockets, decodes and hands messages on; a malformed
frame, or a handler that raises, is logged (rate-limited) and dropped, never ends the loop.
Anything else that escapes the loop is logged and counted (`num_receive_restarts`) and the
loop starts again.
Sends never block: a ROUTER drops what it cannot route, and so do we.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import zmq
import zmq.asyncio

from zeroserve.common.keys import GatewayKeys, curve_server
from zeroserve.common.logging_setup import RateLimited, printable
from zeroserve.common.protocol import (
    INCARNATION_PROPERTY,
    MAX_FRAME_BYTES,
    Message,
    ProtocolError,
    Tokens,
    decode,
    encode,
    incarnation,
)
from zeroserve.common.socket_liveness import set_liveness_options
from zeroserve.gateway.config import prepare_ipc_endpoint
from zeroserve.gateway.logging import get_logger
from zeroserve.gateway.workers.zap import ZAP_DOMAIN, ZapHandler

log = get_logger("zmq")

_MAX_BATCH = 256  # messages drained from one socket per wake-up, so neither starves
_MAX_MSG_BYTES = MAX_FRAME_BYTES + 4096  # a bigger inbound message drops its connection
_RCVHWM = 10_000  # messages queued per socket before ZeroMQ stops reading the peers
_SNDHWM = 10_000  # messages queued per worker; beyond, sends to it are dropped
_RECEIVE_RESTART_PAUSE_S = 0.1  # after the receive loop failed, before it starts again
_RECEIVE_MAX_PAUSE_S = 5.0  # the pause doubles while it keeps failing at once
_RECEIVE_STABLE_S = 10.0  # a loop that ran this long before failing restarts after the least
# Admissions before relay (ZmqEdge._hold_for_admissions): TOKENS wait in naps this long while
# requests keep arriving.
_ADMISSION_NAP_S = 0.002


class ClientStream(Protocol):
    """What DeferredWrites needs of a client's response (gateway/http/sse.py's SSEResponse)."""

    def write_now(self, chunk: bytes) -> None: ...


class DeferredWrites:
    """Chunks for many streams held over one pass of the receive loop and written once per
    stream at its end (the edge turns this on when several TOKENS messages were waiting). The pass runs without yielding to the event loop, so nothing else writes to
    those sockets, or sees them change, in between."""

    def __init__(self) -> None:
        self.is_deferring = False
        self._pending: dict[ClientStream, list[bytes]] = {}

    def add(self, response: ClientStream, chunk: bytes) -> None:
        chunks = self._pending.get(response)
        if chunks is None:
            self._pending[response] = [chunk]
        else:
            chunks.append(chunk)

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for response, chunks in pending.items():
            response.write_now(chunks[0] if len(chunks) == 1 else b"".join(chunks))


@dataclass(frozen=True)
class Peer:
    """Who sent a message. `worker_id`: the worker bound to this route (None: not yet);
    `user_id`: the worker id the peer's CURVE key was issued for (None without keys)."""

    route: bytes | None  # None for the PULL socket (TOKENS)
    worker_id: str | None
    user_id: str | None


Handler = Callable[[Peer, Message], None]


class ZmqEdge:
    def __init__(self, router_address: str, tokens_address: str, on_message: Handler,
                 keys: GatewayKeys | None = None, writes: DeferredWrites | None = None):
        self.router_address = router_address
        # Client writes made while TOKENS are dispatched: held and merged per stream when
        # the gateway is behind (more than one TOKENS message waiting).
        self.writes = writes or DeferredWrites()
        self.tokens_address = tokens_address
        self._on_message = on_message
        self.keys = keys
        # True while new requests are arriving: their admission goes before the relay, for up
        # to max_admission_hold_s at a time (0: never).
        self.admitting: Callable[[], bool] | None = None
        self.max_admission_hold_s = 0.0
        self._next_hold_at = float("-inf")  # the relay runs at least as long as a hold
        self._ctx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._router_now: zmq.Socket | None = None  # see start()
        self._pull_now: zmq.Socket | None = None
        self._zap: ZapHandler | None = None
        self._task: asyncio.Task | None = None
        self._routes: dict[str, bytes] = {}  # worker id -> route
        self._workers: dict[bytes, str] = {}  # route -> worker id
        self._incarnations: dict[str, str] = {}  # worker id -> its bound route's incarnation
        self._warn = RateLimited()
        self.num_dropped = 0  # malformed or refused inbound messages
        self.num_receive_restarts = 0  # the receive loop failed and was started again

    def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        if self.keys is not None:
            self._zap = ZapHandler(self._ctx, self.keys.workers)
            self._zap.start()
        self._router = self._ctx.socket(zmq.ROUTER)
        # A worker reconnecting with its route (a half-open connection still holds it)
        # takes the route over; without this libzmq ignores the new connection for good.
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._pull = self._ctx.socket(zmq.PULL)
        for sock, address in ((self._router, self.router_address),
                              (self._pull, self.tokens_address)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MSG_BYTES)
            sock.setsockopt(zmq.RCVHWM, _RCVHWM)
            sock.setsockopt(zmq.SNDHWM, _SNDHWM)
            set_liveness_options(sock)
            if self.keys is not None:
                curve_server(sock, self.keys, ZAP_DOMAIN)
            prepare_ipc_endpoint(address)
            sock.bind(address)
        # The same sockets, blocking kind, for the receive loop's non-blocking reads (its
        # drains, after the poller said there is input): zmq.asyncio's recv with NOBLOCK
        # makes a future per message and, at the end of every drain, one holding the
        # zmq.Again raised, whose traceback and frames make a reference cycle: garbage for
        # the collector's next pass (issue 36). Sends stay on the asyncio sockets (they
        # re-check the poller's pending reads after each send).
        self._router_now = zmq.Socket.shadow(self._router.underlying)
        self._pull_now = zmq.Socket.shadow(self._pull.underlying)
        self._task = asyncio.create_task(self._supervise_receive(), name="zmq-receive")
        log.info("bound", extra={"router": self.router_address, "tokens": self.tokens_address,
                                 "curve": self.keys is not None})

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._router_now = self._pull_now = None  # (shadows: they close nothing)
        for sock in (self._router, self._pull):
            if sock is not None:
                sock.close(linger=0)
        if self._zap is not None:
            self._zap.stop()
        if self._ctx is not None:
            self._ctx.term()

    # -- routes ---------------------------------------------------------------------------

    def bind_route(self, worker_id: str, route: bytes) -> None:
        """From now on, messages for `worker_id` go to `route` and messages from `route`
        are that worker's (its HELLO was accepted)."""
        old = self._routes.get(worker_id)
        if old is not None:
            self._workers.pop(old, None)
        self._routes[worker_id] = route
        self._workers[route] = worker_id
        self._incarnations[worker_id] = incarnation(route)

    def unbind(self, worker_id: str) -> None:
        self._incarnations.pop(worker_id, None)
        route = self._routes.pop(worker_id, None)
        if route is not None:
            self._workers.pop(route, None)

    # -- sending --------------------------------------------------------------------------

    def send(self, worker_id: str, msg: Message) -> bool:
        """Queue a message to a bound worker; False if it could not be sent."""
        route = self._routes.get(worker_id)
        return route is not None and self.send_route(route, msg)

    def send_route(self, route: bytes, msg: Message) -> bool:
        """Queue a message to whoever holds `route` (a peer not bound yet: HELLO answers)."""
        if self._router is None:
            return False
        future = self._router.send_multipart([route, *encode(msg)], flags=zmq.DONTWAIT)
        if future.done() and future.exception() is not None:
            self._warn_limited("send failed", route=route, msg=type(msg).__name__,
                               error=str(future.exception()))
            return False
        return True

    def is_connected(self, route: bytes, probe: Message) -> bool:
        """Whether some peer holds a connection with `route` now, asked of libzmq by
        sending it `probe` with ROUTER_MANDATORY (a route with no connection fails with
        EHOSTUNREACH). A process that exits, or is killed, closes its connections, so this
        tells a live worker from a dead one at once; a vanished host's half-open connection
        counts as live until ZMTP heartbeats close it (common/socket_liveness.py). Socket
        monitor events cannot tell: they name a connection's file descriptor, not its route.
        """
        if self._router is None:
            return False
        sock = zmq.Socket.shadow(self._router.underlying)  # a plain send: no future to await
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            sock.send_multipart([route, *encode(probe)], flags=zmq.DONTWAIT)
            return True
        except zmq.Again:  # connected, with a full queue
            return True
        except zmq.ZMQError:  # EHOSTUNREACH
            return False
        finally:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)

    # -- receiving ------------------------------------------------------------------------

    async def _supervise_receive(self) -> None:
        """Run the receive loop; an unexpected exception in it (not a handler's: those are
        caught per message) is logged, counted and the loop restarted, so the gateway never
        goes on answering liveness while it has stopped hearing its workers."""
        pause_s = _RECEIVE_RESTART_PAUSE_S
        while True:
            started = time.monotonic()
            try:
                await self._receive_loop()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.num_receive_restarts += 1
                log.exception("the receive loop failed; restarting it",
                              extra={"num_restarts": self.num_receive_restarts})
                if time.monotonic() - started > _RECEIVE_STABLE_S:
                    pause_s = _RECEIVE_RESTART_PAUSE_S
                await asyncio.sleep(pause_s)  # a lasting fault: no hot loop, no log flood
                pause_s = min(2 * pause_s, _RECEIVE_MAX_PAUSE_S)

    async def _receive_loop(self) -> None:
        """The one receive loop: wait until either socket has input, drain both."""
        assert self._router is not None and self._pull is not None
        poller = zmq.asyncio.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            if self._pull in ready:
                await self._hold_for_admissions()
                await self._drain_tokens()
            if self._router in ready:
                await self._drain(self._router_now, self._dispatch_router)

    async def _hold_for_admissions(self) -> None:
        """Let a burst of new requests in before relaying the tokens of those already in.

        Each admission (accept, HTTP parsing, the handler, SUBMIT) takes several passes of
        the loop, and under load each pass also drains the waiting TOKENS: in a burst the
        relay of the streams already admitted took most of the loop, and the last of 1,000
        simultaneous requests got its first token seconds after the first, then streamed
        alone at the end (docs/benchmarks.md, "Admissions before relay"). So while
        `admitting()` says requests keep coming, the drain waits in short naps, during which
        the loop runs their admissions, for up to max_admission_hold_s; then everything
        waiting goes out, one write per stream. The workers run on meanwhile within their
        streams' credit. A hold starts only once the relay has run as long as the last hold
        lasted, so a steady stream of requests takes at most half the loop from the relay."""
        admitting, limit = self.admitting, self.max_admission_hold_s
        if admitting is None or limit <= 0 or not admitting():
            return
        started = time.monotonic()
        if started < self._next_hold_at:
            return
        deadline = started + limit
        while True:
            await asyncio.sleep(_ADMISSION_NAP_S)
            now = time.monotonic()
            if now >= deadline or not admitting():
                break
        self._next_hold_at = now + (now - started)

    async def _drain(self, sock: zmq.Socket, dispatch: Callable[[list], None]) -> None:
        for _ in range(_MAX_BATCH):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            dispatch(frames)

    async def _drain_tokens(self) -> None:
        """Read every TOKENS message waiting (up to _MAX_BATCH), then dispatch them. One
        waiting: its outputs go to their clients as they are dispatched. Several (the
        gateway fell behind the workers' steps): the writes are held until all are
        dispatched and each stream's socket gets one write with all its new events, so a
        gateway under more load spends less per token, not more."""
        pull = self._pull_now
        assert pull is not None
        batch = []
        for _ in range(_MAX_BATCH):
            try:
                batch.append(pull.recv_multipart(flags=zmq.NOBLOCK, copy=False))
            except zmq.Again:
                break
        if len(batch) == 1:
            self._dispatch_tokens(batch[0])
            return
        self.writes.is_deferring = True
        try:
            for frames in batch:
                self._dispatch_tokens(frames)
        finally:
            self.writes.is_deferring = False
            self.writes.flush()

    def _user_id(self, frame: zmq.Frame) -> str | None:
        return frame.get("User-Id") if self.keys is not None else None

    def _dispatch_router(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            self._drop("a frame without a route")
            return
        route = frames[0].bytes
        try:
            msg = decode([f.bytes for f in frames[1:]])
        except ProtocolError as e:
            self._drop("malformed frame", route=route, error=str(e))
            return
        self._handle(Peer(route, self._workers.get(route), self._user_id(frames[1])), msg)

    def _dispatch_tokens(self, frames: list[zmq.Frame]) -> None:
        try:
            msg = decode([f.bytes for f in frames])
        except ProtocolError as e:
            self._drop("malformed frame on the tokens socket", error=str(e))
            return
        if not isinstance(msg, Tokens):
            self._drop("a non-TOKENS message on the tokens socket", msg=type(msg).__name__)
            return
        if msg.seq and not self._is_bound_incarnation(msg.worker_id, frames[0]):
            msg.seq = 0  # another process's: it must not move the bound one's sequence
        self._handle(Peer(None, msg.worker_id, self._user_id(frames[0])), msg)

    def _is_bound_incarnation(self, worker_id: str, frame: zmq.Frame) -> bool:
        """Whether a TOKENS message comes from the process bound to its worker id; True when
        nobody is bound or the sender does not name its process."""
        bound = self._incarnations.get(worker_id)
        if bound is None:
            return True
        try:
            sender = frame.get(INCARNATION_PROPERTY)
        except zmq.ZMQError:  # not set by the sender
            return True
        return sender == bound

    def _handle(self, peer: Peer, msg: Message) -> None:
        try:
            self._on_message(peer, msg)
        except Exception:  # a handler bug must not end the loop
            log.exception("handler failed", extra={"worker_id": printable(peer.worker_id),
                                                   "msg": type(msg).__name__})

    def _drop(self, what: str, route: bytes | None = None, **extra: str) -> None:
        self.num_dropped += 1
        self._warn_limited(f"dropped {what}", route=route, **extra)

    def _warn_limited(self, what: str, route: bytes | None = None, **extra: str) -> None:
        num_held = self._warn.allow(what)
        if num_held is None:
            return
        fields = {k: printable(v) for k, v in extra.items()}
        if route is not None:
            fields["route"] = printable(route.decode(errors="replace"))
        log.warning(what, extra={**fields, "num_held_back": num_held})
