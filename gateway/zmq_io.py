"""The gateway's ZeroMQ edge: it binds the sockets, runs the receive loops, sends.

- ROUTER (ROUTER_HANDOVER on, so a restarted worker with the same id takes its identity
  over): control both ways; frames are [identity, type, body].
- PULL: TOKENS from every worker's PUSH; frames are [type, body].

One receive loop polls both sockets, decodes and hands messages on; a malformed frame, or
a handler that raises, is logged and dropped, never ends the loop. Sends never block: a ROUTER drops what it cannot
route, and so do we.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq
import zmq.asyncio

from common.protocol import Message, ProtocolError, Tokens, decode, encode
from gateway.config import prepare_ipc_endpoint
from gateway.logging import get_logger

log = get_logger("zmq")

# (identity, message): the ROUTER peer's identity, or for TOKENS the sending worker's id.
Handler = Callable[[str, Message], None]
_MAX_BATCH = 256  # messages drained from one socket per wake-up, so neither starves


class ZmqEdge:
    def __init__(self, router_address: str, tokens_address: str, on_message: Handler):
        self.router_address = router_address
        self.tokens_address = tokens_address
        self._on_message = on_message
        self._ctx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.setsockopt(zmq.LINGER, 0)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        for sock, address in ((self._router, self.router_address),
                              (self._pull, self.tokens_address)):
            prepare_ipc_endpoint(address)
            sock.bind(address)
        self._task = asyncio.create_task(self._receive_loop(), name="zmq-receive")
        log.info("bound", extra={"router": self.router_address, "tokens": self.tokens_address})

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for sock in (self._router, self._pull):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    def send(self, worker_id: str, msg: Message) -> bool:
        """Queue a message to one worker; False if it could not be sent."""
        if self._router is None:
            return False
        future = self._router.send_multipart([worker_id.encode(), *encode(msg)],
                                             flags=zmq.DONTWAIT)
        if future.done() and future.exception() is not None:
            log.warning("send failed", extra={"worker_id": worker_id,
                                              "msg": type(msg).__name__,
                                              "error": str(future.exception())})
            return False
        return True

    async def _receive_loop(self) -> None:
        """The one receive loop: wait until either socket has input, drain both."""
        assert self._router is not None and self._pull is not None
        poller = zmq.asyncio.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            if self._pull in ready:
                await self._drain(self._pull, self._dispatch_tokens)
            if self._router in ready:
                await self._drain(self._router, self._dispatch_router)

    async def _drain(self, sock: zmq.asyncio.Socket, dispatch: Callable[[list], None]) -> None:
        for _ in range(_MAX_BATCH):
            try:
                frames = await sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            dispatch(frames)

    def _dispatch_router(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            log.warning("dropped a frame without identity")
            return
        identity = frames[0].decode(errors="replace")
        try:
            msg = decode(frames[1:])
        except ProtocolError as e:
            log.warning("dropped malformed frame", extra={"worker_id": identity,
                                                          "error": str(e)})
            return
        self._handle(identity, msg)

    def _dispatch_tokens(self, frames: list[bytes]) -> None:
        try:
            msg = decode(frames)
        except ProtocolError as e:
            log.warning("dropped malformed frame", extra={"error": str(e)})
            return
        if not isinstance(msg, Tokens):
            log.warning("dropped non-TOKENS message on the tokens socket",
                        extra={"msg": type(msg).__name__})
            return
        self._handle(msg.worker_id, msg)

    def _handle(self, identity: str, msg: Message) -> None:
        try:
            self._on_message(identity, msg)
        except Exception:  # a handler bug must not end the loop
            log.exception("handler failed", extra={"worker_id": identity,
                                                   "msg": type(msg).__name__})
