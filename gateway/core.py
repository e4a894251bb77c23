"""The gateway's core: request table, worker registry, admission, and the message handlers.

One receive loop per socket (gateway/zmq_io.py) calls `_on_router` / `_on_tokens`; those
dispatch by message type through a table and only touch in-memory state and queues. HTTP
handlers create request states, `submit` them, consume their sink queues, grant credit and
`finish` them. Every way a request ends goes through `finish` (or `_fail`, which delivers
an error that makes the handler call `finish`), so nothing stays in the tables.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from common.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Credit,
    Drain,
    Error,
    Heartbeat,
    Hello,
    Message,
    MsgType,
    Ready,
    Submit,
    Tokens,
)
from gateway.admission import Admission
from gateway.config import GatewayConfig
from gateway.errors import APIError, server_error, worker_failed
from gateway.logging import get_logger
from gateway.registry import WorkerRegistry
from gateway.streams import CreditLedger, RequestPhase, RequestState, StreamTable
from gateway.zmq_io import ZmqEdge

log = get_logger("core")


class Gateway:
    def __init__(self, config: GatewayConfig, clock=time.monotonic):
        self.config = config
        self.clock = clock
        self.registry = WorkerRegistry(config.max_waiting_per_worker)
        self.streams = StreamTable()
        self.admission = Admission(self.registry, config.max_queued_requests,
                                   config.queue_timeout_s)
        router, tokens = config.endpoints
        self.edge = ZmqEdge(router, tokens, self._on_router, self._on_tokens)
        self.credits = CreditLedger(self._send_credit)
        self._handlers = {
            MsgType.HELLO: self._on_hello,
            MsgType.HEARTBEAT: self._on_heartbeat,
            MsgType.DRAIN: self._on_drain,
            MsgType.ERROR: self._on_error,
        }
        self._heartbeat_task: asyncio.Task | None = None

    # --- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        self.edge.start()
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")

    async def stop(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            try:
                await self._heartbeat_task
            except asyncio.CancelledError:
                pass
        for state in list(self.streams.states.values()):
            self._fail(state, APIError(503, "The server is shutting down.",
                                       type="service_unavailable", code="shutdown"))
            if state.worker_id is not None:
                self.edge.send(state.worker_id, Abort([state.request_id]))
        await self.edge.close()

    # --- requests (called by HTTP handlers) -------------------------------------------

    def new_request(self, index: int, prompt_token_ids: list[int],
                    sink: asyncio.Queue) -> RequestState:
        state = RequestState(f"req-{uuid.uuid4().hex}", index, prompt_token_ids, sink)
        self.streams.add(state)
        return state

    async def submit(self, state: RequestState, params: dict[str, Any]) -> None:
        """Wait for a worker (admission) and send the request to it. Raises APIError."""
        worker = await self.admission.acquire(state.request_id)
        if state.phase is not RequestPhase.QUEUED:  # ended while it waited
            self.registry.release(worker.worker_id, state.request_id)
            self.admission.wake()
            return
        state.worker_id = worker.worker_id
        state.phase = RequestPhase.RUNNING
        sent = self.edge.send(worker.worker_id, Submit(
            state.request_id, state.prompt_token_ids, params, self.config.credit_window))
        log.debug("submitted", extra={"request_id": state.request_id,
                                      "worker_id": worker.worker_id})
        if not sent:
            self._fail(state, worker_failed(f"Could not reach worker {worker.worker_id}."))

    def grant(self, state: RequestState, num_tokens: int) -> None:
        """The client took these tokens: let the worker send as many more."""
        self.credits.grant(state, num_tokens)

    def finish(self, state: RequestState, abort: bool) -> None:
        """End a request for good. `abort`: the worker may still be running it."""
        if self.streams.remove(state.request_id) is None:
            return
        if state.worker_id is not None:
            if abort:
                self.edge.send(state.worker_id, Abort([state.request_id]))
            self.registry.release(state.worker_id, state.request_id)
            self.admission.wake()

    def _fail(self, state: RequestState, error: APIError) -> None:
        """Deliver an error to the request's handler (which then calls finish)."""
        if state.worker_id is not None:
            self.registry.release(state.worker_id, state.request_id)
        state.deliver(error)

    def _send_credit(self, worker_id: str, grants: list[list]) -> None:
        self.edge.send(worker_id, Credit(grants))

    # --- worker messages (called by the receive loops) ----------------------------------

    def _on_router(self, identity: str, msg: Message) -> None:
        handler = self._handlers.get(msg.TYPE)
        if handler is None:
            log.warning("unexpected message from worker",
                        extra={"worker_id": identity, "msg": type(msg).__name__})
            return
        handler(identity, msg)

    def _on_hello(self, identity: str, msg: Hello) -> None:
        if msg.protocol_version != PROTOCOL_VERSION:
            reason = (f"protocol version {msg.protocol_version} is not the gateway's "
                      f"{PROTOCOL_VERSION}")
            log.error("refused worker", extra={"worker_id": identity, "reason": reason})
            self.edge.send(identity, Ready(False, reason, self.config.heartbeat_interval_s))
            return
        if msg.worker_id != identity:
            log.warning("HELLO worker_id differs from its socket identity; using the identity",
                        extra={"worker_id": identity, "hello_worker_id": msg.worker_id})
            msg.worker_id = identity
        old = self.registry.register(msg, self.clock())
        if old is not None:
            self._fail_worker_requests(old.worker_id, "restarted")
        log.info("worker ready", extra={"worker_id": identity, "pid": msg.pid,
                                        "device": msg.device, "model": msg.model,
                                        "max_model_len": msg.max_model_len,
                                        "num_kv_blocks": msg.num_kv_blocks})
        self.edge.send(identity, Ready(True, "", self.config.heartbeat_interval_s))
        self.admission.wake()

    def _on_heartbeat(self, identity: str, msg: Heartbeat) -> None:
        msg.worker_id = identity
        if self.registry.on_heartbeat(msg, self.clock()) is not None:
            self.admission.wake()

    def _on_drain(self, identity: str, msg: Drain) -> None:
        if self.registry.mark_draining(identity) is not None:
            log.info("worker draining", extra={"worker_id": identity})

    def _on_error(self, identity: str, msg: Error) -> None:
        log.error("worker error", extra={"worker_id": identity, "request_id": msg.request_id,
                                         "code": msg.code, "error": msg.message})
        state = self.streams.get(msg.request_id) if msg.request_id else None
        if state is not None and state.worker_id == identity:
            self._fail(state, server_error(f"The worker failed the request: {msg.message}"))

    def _on_tokens(self, msg: Tokens) -> None:
        self.registry.touch(msg.worker_id, self.clock())
        is_capacity_freed = False
        for out in msg.outputs:
            state = self.streams.get(out.request_id)
            if state is None or state.worker_id != msg.worker_id:
                continue  # ended here already (aborted, stop string, lost worker)
            state.num_received += len(out.new_token_ids)
            if out.finish_reason is not None:
                self.registry.release(msg.worker_id, out.request_id)
                is_capacity_freed = True
            state.deliver(out)
        if is_capacity_freed:
            self.admission.wake()

    # --- liveness ---------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        while True:
            expected = self.clock() + interval
            await asyncio.sleep(interval)
            try:
                self._beat(lag_s=max(0.0, self.clock() - expected))
            except Exception:
                log.exception("heartbeat failed")

    def _beat(self, lag_s: float = 0.0) -> None:
        """Expire silent workers, then send our heartbeats. `lag_s`: how late this tick ran.
        While our own loop was too busy to run, it was too busy to read heartbeats too, so
        that time does not count as a worker's silence."""
        now = self.clock()
        if lag_s > 0:
            for worker in self.registry.workers.values():
                worker.last_seen = min(now, worker.last_seen + lag_s)
        for worker in self.registry.expire(now, self.config.worker_timeout_s):
            log.error("worker lost", extra={"worker_id": worker.worker_id,
                                            "silent_s": round(now - worker.last_seen, 3),
                                            "num_in_flight": len(worker.request_ids)})
            self._fail_worker_requests(worker.worker_id, "was lost (no heartbeat)")
        for worker_id in list(self.registry.workers):
            self.edge.send(worker_id, Heartbeat(worker_id=worker_id, time=time.time()))

    def _fail_worker_requests(self, worker_id: str, what: str) -> None:
        for state in self.streams.on_worker(worker_id):
            self._fail(state, worker_failed(
                f"The worker serving this request ({worker_id}) {what}; please retry."))
