"""The gateway's ZeroMQ edge: it binds the sockets, runs the receive loops, sends.

- ROUTER (ROUTER_HANDOVER on, so a restarted worker with the same id takes its identity
  over): control both ways; frames are [identity, type, body].
- PULL: TOKENS from every worker's PUSH; frames are [type, body].

Receive loops decode and hand messages on; a malformed frame, or a handler that raises,
is logged and dropped, never ends a loop. Sends never block: a ROUTER drops what it cannot
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

RouterHandler = Callable[[str, Message], None]
TokensHandler = Callable[[Tokens], None]


class ZmqEdge:
    def __init__(self, router_address: str, tokens_address: str, on_router: RouterHandler,
                 on_tokens: TokensHandler):
        self.router_address = router_address
        self.tokens_address = tokens_address
        self._on_router = on_router
        self._on_tokens = on_tokens
        self._ctx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []

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
        self._tasks = [asyncio.create_task(self._router_loop(), name="zmq-router"),
                       asyncio.create_task(self._pull_loop(), name="zmq-pull")]
        log.info("bound", extra={"router": self.router_address, "tokens": self.tokens_address})

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        for sock in (self._router, self._pull):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._tasks = []

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

    async def _router_loop(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) < 2:
                log.warning("dropped a frame without identity")
                continue
            identity = frames[0].decode(errors="replace")
            try:
                msg = decode(frames[1:])
            except ProtocolError as e:
                log.warning("dropped malformed frame", extra={"worker_id": identity,
                                                              "error": str(e)})
                continue
            try:
                self._on_router(identity, msg)
            except Exception:
                log.exception("handler failed", extra={"worker_id": identity,
                                                       "msg": type(msg).__name__})

    async def _pull_loop(self) -> None:
        assert self._pull is not None
        while True:
            frames = await self._pull.recv_multipart()
            try:
                msg = decode(frames)
            except ProtocolError as e:
                log.warning("dropped malformed frame", extra={"error": str(e)})
                continue
            if not isinstance(msg, Tokens):
                log.warning("dropped non-TOKENS message on the tokens socket",
                            extra={"msg": type(msg).__name__})
                continue
            try:
                self._on_tokens(msg)
            except Exception:
                log.exception("tokens handler failed", extra={"worker_id": msg.worker_id})
