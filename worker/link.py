"""The worker's link to one gateway: a thread that owns that gateway's DEALER socket.

A worker behind several gateway processes (`zeroserve serve --gateways N`) runs one link per
gateway; every link puts what it hears into the engine thread's one inbox, tagged with the
link's index, so the engine thread knows which gateway a message came from.

It keeps liveness off the engine thread: heartbeats leave on their own clock even while a
long engine step runs, HELLOs are held and retried until a connection takes them, and a
watchdog ends the process when the engine thread stops making progress (a hung kernel or a
deadlock that no step of ours can free), so its supervisor starts a fresh one. It answers
DEBUG_REQUESTs itself (worker/debug.py, on a thread of their own), never through the
engine thread, so a hung engine still shows its stacks.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import queue
import secrets
import threading
import time

import zmq

from zeroserve.common.keys import WorkerKeys, curve_client
from zeroserve.common.protocol import (
    INCARNATION_PROPERTY,
    MAX_FRAME_BYTES,
    DebugReply,
    DebugRequest,
    Heartbeat,
    Message,
    MsgType,
    ProtocolError,
    WorkerState,
    decode,
    encode,
    incarnation,
)
from zeroserve.common.socket_liveness import set_liveness_options
from zeroserve.worker.config import WorkerConfig
from zeroserve.worker.debug import WorkerDebug

log = logging.getLogger("zeroserve.worker")

EXIT_STALLED = 4  # the engine thread made no progress for stall_timeout_s
LINGER_MS = 2000  # on exit, how long queued messages (final tokens, DRAIN) may take to leave
SNDHWM = 100_000  # messages queued while the gateway is away; beyond this we drop, never block
MAX_MSG_BYTES = MAX_FRAME_BYTES + 4096  # a bigger inbound message drops the connection


def new_route(worker_id: str) -> bytes:
    """The worker process's route (its DEALER routing id): its id plus a secret suffix, new
    every process run. The gateway sends to us only through the route our HELLO came from,
    so no other peer can take our place, and a new route tells it we restarted. Every link
    of one process uses the same route: each gateway of `serve --gateways N` names the
    process by it (the `incarnation` its admin API shows), so all of them must name it alike.
    """
    return f"{worker_id}.{secrets.token_hex(12)}".encode()


class GatewayLink(threading.Thread):
    """Owns the DEALER: decoded gateway messages go to `inbox`; frames that the engine
    thread pushes into the inproc outbox go out; heartbeats go out on their own clock.

    The DEALER queues only to a live connection (ZMQ_IMMEDIATE), so nothing piles up for a
    gateway that is down: heartbeats are dropped, and a HELLO is held here and retried until
    a connection takes it (then `hello_sent_at` says when).
    """

    _HELLO_RETRY_S = 0.1

    def __init__(self, ctx: zmq.Context, config: WorkerConfig, route: bytes,
                 router_address: str, outbox_address: str, keys: WorkerKeys | None,
                 inbox: queue.Queue[tuple[int, Message]], index: int = 0,
                 debug: WorkerDebug | None = None):
        super().__init__(name=f"gateway-link-{index}", daemon=True)
        self.debug = debug  # answers DEBUG_REQUESTs here, never on the engine thread
        self.config = config
        self.index = index  # which of the worker's gateways this link talks to
        self.inbox = inbox  # (index, message) for the engine thread; shared by all links
        self.last_heard = time.monotonic()  # monotonic time of the last gateway message
        self.hello_sent_at: float | None = None  # when the last HELLO reached a connection
        # The engine thread replaces these (never mutates them) every loop iteration: its
        # load with the request ids it holds, and when that id snapshot was taken.
        self.load = (Heartbeat(config.worker_id, WorkerState.STARTING.value), time.monotonic())
        self.progress_at = time.monotonic()  # the engine thread's last finished iteration
        self._pending_hello: list[bytes] | None = None
        self._dealer = ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, route)  # see new_route
        self._dealer.setsockopt(zmq.IMMEDIATE, 1)
        self._dealer.setsockopt(zmq.LINGER, LINGER_MS)
        self._dealer.setsockopt(zmq.SNDHWM, SNDHWM)
        self._dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)
        set_liveness_options(self._dealer)
        if keys is not None:
            curve_client(self._dealer, keys)
        self._dealer.connect(router_address)
        self._outbox = ctx.socket(zmq.PULL)
        self._outbox.bind(outbox_address)
        self._ctx, self._outbox_address = ctx, outbox_address

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._outbox, zmq.POLLIN)
        # The first beat waits one interval so the engine thread's HELLO goes out first.
        next_beat = time.monotonic() + self.config.heartbeat_interval_s
        try:
            while True:
                now = time.monotonic()
                if now >= next_beat:
                    self._check_stall(now)
                    self._send(encode(self.heartbeat(now)))
                    next_beat = now + self.config.heartbeat_interval_s
                if self._pending_hello is not None and self._send(self._pending_hello):
                    self._pending_hello = None
                    self.hello_sent_at = now
                wake_at = next_beat if self._pending_hello is None else now + self._HELLO_RETRY_S
                ready = dict(poller.poll(max(0.0, min(wake_at, next_beat) - now) * 1000))
                if self._dealer in ready:
                    self._receive_all()
                if self._outbox in ready and not self._forward_outbox():
                    return
        finally:
            self._dealer.close()
            self._outbox.close()

    def heartbeat(self, now: float) -> Heartbeat:
        """The latest published load as a heartbeat at `now`: a new message, so that either
        thread may build one (the link's beats, the engine thread's GatewayPeer.beat_now)."""
        load, ids_at = self.load
        return dataclasses.replace(load, time=time.time(),
                                   progress_age_s=max(0.0, now - self.progress_at),
                                   request_ids_age_s=max(0.0, now - ids_at))

    def _check_stall(self, now: float) -> None:
        """The engine thread is stuck (a hung kernel, a deadlock): no step of ours can free
        it, so exit and let the supervisor or container runtime start a fresh process."""
        limit = self.config.stall_timeout_s
        if limit is not None and now - self.progress_at > limit:
            log.critical("engine made no progress for %.0fs; exiting so that this worker is "
                         "restarted", now - self.progress_at,
                         extra={"worker_id": self.config.worker_id})
            logging.shutdown()
            os._exit(EXIT_STALLED)

    def _receive_all(self) -> None:
        while True:
            try:
                frames = self._dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.last_heard = time.monotonic()
            try:
                msg = decode(frames)
            except ProtocolError as e:
                log.warning("dropped a bad frame from the gateway: %s", e,
                            extra={"worker_id": self.config.worker_id})
                continue
            if isinstance(msg, DebugRequest) and self.debug is not None:
                self.debug.handle(msg, self._reply_from_thread)
            else:
                self.inbox.put((self.index, msg))

    def _reply_from_thread(self, reply: DebugReply) -> None:
        """Send from another thread (a debug answer's): through the outbox, like the engine
        thread, on a socket of its own (ZeroMQ sockets are not shared between threads)."""
        sock = None
        try:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, LINGER_MS)
            sock.connect(self._outbox_address)
            sock.send_multipart(encode(reply))
        except zmq.ZMQError as e:  # the worker is exiting: the gateway's call times out
            log.warning("could not send a debug reply: %s", e,
                        extra={"worker_id": self.config.worker_id})
        finally:
            if sock is not None:
                sock.close()

    def _forward_outbox(self) -> bool:
        """Send what the engine thread queued; False when it asked us to stop."""
        while True:
            try:
                frames = self._outbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if frames == [b"stop"]:
                return False
            if frames[0] == bytes([MsgType.HELLO]):
                self._pending_hello = frames  # sent (and retried) by the loop
                self.hello_sent_at = None
            elif not self._send(frames):
                log.warning("no gateway connection; dropped a %s message",
                            MsgType(frames[0][0]).name, extra={"worker_id": self.config.worker_id})

    def _send(self, frames: list[bytes]) -> bool:
        try:
            self._dealer.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False


class TokenSender(threading.Thread):
    """Encodes and sends one gateway's TOKENS messages off the engine thread.

    The engine thread builds a step's rows and hands them over (`put`); msgpack and the
    socket send run here, while the engine thread goes on to the next step (its forward
    releases the GIL: a GPU's, or the fake backend's sleep). At 1,000 streams that took
    0.6 ms of CPU a step, and more of wall time, out of the step's critical path. Order is
    kept (one thread, one queue per gateway), and this thread alone uses the PUSH socket
    once it has started.
    """

    _STOP = object()

    def __init__(self, sock: zmq.Socket, worker_id: str, index: int):
        super().__init__(name=f"token-sender-{index}", daemon=True)
        self._sock = sock
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._worker_id = worker_id
        self._index = index

    def put(self, msg: Message) -> None:
        self._queue.put(msg)

    def stop(self) -> None:
        """Send what is queued, then close the socket (within LINGER_MS)."""
        self._queue.put(self._STOP)

    def run(self) -> None:
        try:
            while (msg := self._queue.get()) is not self._STOP:
                try:
                    self._sock.send_multipart(encode(msg), zmq.NOBLOCK)
                except zmq.Again:
                    log.warning("token queue full; dropped step %d", msg.step,
                                extra={"worker_id": self._worker_id, "gateway": self._index})
        finally:
            self._sock.close()


class LinkState(enum.Enum):
    CONNECTING = "connecting"  # HELLO sent, no READY yet
    CONNECTED = "connected"


class GatewayPeer:
    """The engine thread's handle on one gateway: the link thread that owns its DEALER, the
    inproc socket that feeds that thread, the PUSH that carries TOKENS to the gateway's PULL,
    and what the engine thread knows of that gateway process (its id, whether it answered).
    Only the engine thread touches these sockets and fields."""

    def __init__(self, ctx: zmq.Context, config: WorkerConfig, route: bytes, index: int,
                 router_address: str, tokens_address: str, keys: WorkerKeys | None,
                 inbox: queue.Queue[tuple[int, Message]], debug: WorkerDebug | None = None):
        self.index = index
        self.state = LinkState.CONNECTING
        self.gateway_id: str | None = None  # the gateway process we serve here (from READY)
        self.tokens_seq = 0  # TOKENS messages sent to this gateway (Tokens.seq of the last)
        self.endpoints = (router_address, tokens_address)
        outbox_address = f"inproc://worker-outbox-{id(self)}"
        self.link = GatewayLink(ctx, config, route, router_address, outbox_address, keys, inbox,
                                index, debug)
        self._to_link = ctx.socket(zmq.PUSH)
        self._to_link.connect(outbox_address)
        tokens = ctx.socket(zmq.PUSH)
        tokens.setsockopt(zmq.LINGER, LINGER_MS)
        tokens.setsockopt(zmq.SNDHWM, SNDHWM)
        tokens.setsockopt(zmq.METADATA, f"{INCARNATION_PROPERTY}:{incarnation(route)}".encode())
        set_liveness_options(tokens)
        if keys is not None:
            curve_client(tokens, keys)
        tokens.connect(tokens_address)
        self._sender = TokenSender(tokens, config.worker_id, index)

    def start(self) -> None:
        self.link.start()
        self._sender.start()

    def send_control(self, frames: list[bytes]) -> None:
        """HELLO, DRAIN: through the link thread, which owns the DEALER."""
        self._to_link.send_multipart(frames)

    def beat_now(self) -> None:
        """A heartbeat of the load published so far, sent now through the link thread (after
        the control messages queued before it): built here, so it says the state of this
        moment even if the state changes before the link thread sends it."""
        self._to_link.send_multipart(encode(self.link.heartbeat(time.monotonic())))

    def send_tokens(self, msg: Message) -> None:
        """One TOKENS message, encoded and sent by this gateway's sender thread (dropped,
        with a warning, if the queue to the gateway is full)."""
        self._sender.put(msg)

    def request_stop(self) -> None:
        self._to_link.send_multipart([b"stop"])
        self._sender.stop()

    def close(self) -> None:
        """After request_stop: wait for the link and sender threads (they send what they
        hold, within LINGER_MS) and close."""
        self.link.join(timeout=LINGER_MS / 1000 + 1)
        if self._sender.is_alive():
            self._sender.join(timeout=LINGER_MS / 1000 + 1)
        self._to_link.close(linger=0)
