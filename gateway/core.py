"""The gateway's core: request table, worker registry, admission, and the message handlers.

The receive loop (gateway/workers/zmq_io.py) calls `_on_message`, which dispatches by message type
through a table; handlers only touch in-memory state and queues. HTTP
handlers create request states, `submit` them, consume their sink queues, grant credit and
`finish` them. Every way a request ends goes through `finish` (or `_fail`, which delivers
an error that makes the handler call `finish`), so nothing stays in the tables.

Every message may be lost, so no request waits on one forever (gateway/reconcile.py):
worker heartbeats list the requests each worker holds, and the two sides' tables are
reconciled; token counts show gaps; credit limits are re-sent to idle streams; a stream
with credit and no output for `request_idle_timeout_s` fails.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from typing import Any

from zeroserve.common.keys import is_worker_id_valid, load_gateway_keys
from zeroserve.common.logging_setup import RateLimited, printable
from zeroserve.common.model_files import model_display_name
from zeroserve.common.protocol import (
    POISON_REQUEST,
    PROTOCOL_VERSION,
    UNKNOWN_WORKER,
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
    TokenOutput,
    Tokens,
    Undrain,
)
from zeroserve.gateway.admission import Admission
from zeroserve.gateway.class_shares import ClassShares
from zeroserve.gateway.config import GatewayConfig
from zeroserve.gateway.errors import (
    APIError,
    request_timeout,
    server_error,
    shutting_down,
    worker_failed,
)
from zeroserve.gateway.key_limits import load_priorities
from zeroserve.gateway.logging import get_logger
from zeroserve.gateway.observability.metrics import Metrics, RequestMetrics
from zeroserve.gateway.observability.tracing import RequestTracer
from zeroserve.gateway.reconcile import TOKENS_OK, Reconciler, TokenCheck, check_token_counts
from zeroserve.gateway.streams import (
    RequestPhase,
    RequestState,
    Sink,
    StreamTable,
    WorkerOutbox,
)
from zeroserve.gateway.workers.debug_calls import DebugCalls
from zeroserve.gateway.workers.flow_load import wire_flow
from zeroserve.gateway.workers.handle import WorkerHandle, WorkerStatus
from zeroserve.gateway.workers.models import ModelCatalog, Target
from zeroserve.gateway.workers.registry import WorkerRegistry
from zeroserve.gateway.workers.zmq_io import Peer, ZmqEdge

log = get_logger("core")

# A stream whose worker stopped serving it (lost, restarted, drained past its deadline, or a
# message of it was lost) continues on another worker from the tokens it already produced:
# at most this many SUBMITs per request in all, then it fails.
MAX_SUBMITS = 4
# A request that a worker refused with an error before any output gets one more try.
MAX_SUBMITS_AFTER_ERROR = 2
# Requests are being admitted while each comes within this long of the one before (500 a
# second or more: a burst): the relay lets them in first (Gateway.is_admitting).
ADMISSION_GAP_S = 0.002


class Gateway:
    def __init__(self, config: GatewayConfig, clock=time.monotonic,
                 metrics: RequestMetrics | None = None, tracer: RequestTracer | None = None,
                 models: ModelCatalog | None = None):
        self.config = config
        # The models served, their names and aliases (gateway/workers/models.py).
        self.models = models or _one_model(config)
        self.clock = clock
        # Counted here from the streams, so a worker's restart cannot make them go back.
        self.metrics = metrics or Metrics(config.served_model_name or "").requests
        self.tracer = tracer  # a span tree per finished request (gateway/observability/tracing.py), or None
        # Tells workers which gateway process speaks: a new one means the old streams are gone.
        self.gateway_id = uuid.uuid4().hex
        self.registry = WorkerRegistry(config.max_waiting_per_worker,
                                       config.worker_stall_timeout_s, config.routing)
        self.streams = StreamTable()
        self.priorities = load_priorities(config.rate_limits_file, config.api_keys)
        self.admission = Admission(self.registry, config.max_queued_requests,
                                   config.queue_timeout_s, classes=self.priorities.classes,
                                   is_fair=config.scheduling_policy == "fair")
        # Shares the admin API set before a restart, unless the limits file changed them since.
        self.class_shares = ClassShares(config.class_shares_file, self.priorities.classes)
        for name, share in self.class_shares.restore().items():
            self.admission.set_share(name, share)
        router, tokens = config.endpoints
        keys = None if config.keys_dir is None else load_gateway_keys(config.keys_dir)
        self.edge = ZmqEdge(router, tokens, self._on_message, keys)
        self.edge.admitting = self.is_admitting
        self.edge.max_admission_hold_s = config.admission_hold_s
        self._last_request_at = float("-inf")  # clock() when the newest request came
        self.outbox = WorkerOutbox(
            send_credit=lambda worker_id, grants: self.edge.send(worker_id, Credit(grants)),
            send_abort=lambda worker_id, rids, attempts: self.edge.send(
                worker_id, Abort(rids, attempts)))
        self.debug_calls = DebugCalls(self.edge.send)  # stacks/profiles of workers
        self._handlers = {
            MsgType.HELLO: self._on_hello,
            MsgType.HEARTBEAT: self._on_heartbeat,
            MsgType.DRAIN: self._on_drain,
            MsgType.ERROR: self._on_error,
            MsgType.TOKENS: self._on_tokens,
            MsgType.DEBUG_REPLY: self.debug_calls.on_reply,
        }
        self._heartbeat_task: asyncio.Task | None = None
        self._resubmit_tasks: set[asyncio.Task] = set()
        self.reconciler = Reconciler(self.streams, self.outbox, self._on_request_lost,
                                     self._on_request_idle, config.request_idle_timeout_s)
        self._hailed_at: dict[bytes, float] = {}  # unknown route -> when we asked for HELLO
        self._warn = RateLimited()

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
        self.end_requests()
        await self.edge.close()

    def begin_shutdown(self) -> None:
        """The HTTP server stops: requests waiting for a worker, and any new one, get a 503
        now; running ones go on (end_requests ends them at the server's deadline)."""
        self.admission.close(shutting_down())

    def end_requests(self) -> None:
        """End every open request with a 503 (an error event for a stream), and abort it on
        its worker: while their clients can still be told, not when the server cancels."""
        self.admission.close(shutting_down())
        self.debug_calls.end_all(shutting_down())
        for task in list(self._resubmit_tasks):
            task.cancel()
        for state in list(self.streams.states.values()):
            self._fail(state, shutting_down())
            if state.worker_id is not None:
                self.edge.send(state.worker_id, Abort([state.request_id], [state.attempt]))
        self.outbox.flush()

    # --- requests (called by HTTP handlers) -------------------------------------------

    def new_request(self, index: int, prompt_token_ids: list[int],
                    sink: Sink) -> RequestState:
        self._last_request_at = self.clock()
        state = RequestState(f"req-{random_hex()}", index, prompt_token_ids, sink,
                             credit_window=self.config.credit_window)
        self.streams.add(state)
        return state

    def is_admitting(self) -> bool:
        """Are requests coming in as a burst (the newest within ADMISSION_GAP_S)? Then more
        are on their way through the loop, and the relay lets them in first
        (ZmqEdge._hold_for_admissions)."""
        return self.clock() - self._last_request_at < ADMISSION_GAP_S

    async def submit(self, state: RequestState, params: dict[str, Any]) -> None:
        """Wait for a worker (admission) and send the request to it. Raises APIError."""
        state.params = params
        worker = await self.admission.acquire(state.request_id, state.prompt_token_ids,
                                              state.cache_key, state.target, state.ticket)
        if state.phase is not RequestPhase.QUEUED:  # ended while it waited
            self.registry.release(worker.worker_id, state.request_id)
            self.admission.wake()
            return
        self._send_submit(state, worker)

    def submit_now(self, state: RequestState, params: dict[str, Any]) -> bool:
        """`submit` when a worker can take the request at once (nobody queued ahead): sent,
        True; False: nothing was done, `submit` waits its turn. Raises APIError."""
        worker = self.admission.try_acquire(state.request_id, state.prompt_token_ids,
                                            state.cache_key, state.target,
                                            None if state.ticket is None else state.ticket.rank,
                                            None if state.ticket is None else state.ticket.client)
        if worker is None:
            return False
        state.params = params
        self._send_submit(state, worker)
        return True

    def _send_submit(self, state: RequestState, worker: WorkerHandle) -> None:
        state.worker_id = worker.worker_id
        state.phase = RequestPhase.RUNNING
        # Pinned to this worker's model and version: a resubmission goes to the same pair.
        state.target = (state.target or Target(worker.model)).pinned(worker.version)
        if not state.num_submits:
            self.metrics.on_routed(worker.model, worker.version)
        state.num_submits += 1
        state.submitted_at = state.last_activity = self.clock()
        state.missing_since = None
        # params holds the sampling fields and, for constrained decoding, "grammar"
        # ([kind, source]), which travels in SUBMIT's own field.
        params = state.params
        assert params is not None
        sampling = params if "grammar" not in params else \
            {k: v for k, v in params.items() if k != "grammar"}
        state.num_credited = state.num_delivered  # a new worker gets the whole window
        sent = self.edge.send(worker.worker_id, Submit(
            state.request_id, state.prompt_token_ids, sampling, state.credit_limit,
            state.output_token_ids, params.get("grammar"), state.attempt,
            self._wire_priority(state), self._wire_flow(state)))
        if log.isEnabledFor(logging.DEBUG):  # (not even its fields built otherwise)
            log.debug("submitted", extra={"request_id": state.request_id,
                                          "worker_id": worker.worker_id,
                                          "attempt": state.attempt})
        if not sent:
            self._fail(state, worker_failed(f"Could not reach worker {worker.worker_id}."))

    def _wire_priority(self, state: RequestState) -> int:
        """SUBMIT.priority: the request's class for the worker's queue and preemption."""
        if state.ticket is None or not self.admission.is_fair:
            return 0
        return self.priorities.classes.wire_priority(state.ticket.rank)

    def _wire_flow(self, state: RequestState) -> int:
        """SUBMIT.flow: the request's client, hashed, for the worker's fair share of slots
        (0 with fcfs: the worker's plain FIFO)."""
        if state.ticket is None or not self.admission.is_fair:
            return 0
        return wire_flow(state.ticket.client)

    def grant(self, state: RequestState, num_tokens: int) -> None:
        """The client took these tokens: let the worker send as many more."""
        self.outbox.grant(state, num_tokens)

    def finish(self, state: RequestState, abort: bool) -> None:
        """End a request for good. `abort`: the worker may still be running it."""
        if self.streams.remove(state.request_id) is None:
            return
        if state.resubmit_task is not None and not state.resubmit_task.done():
            state.resubmit_task.cancel()  # it may be holding a queue slot
        if state.worker_id is not None:
            if abort:
                self.outbox.abort(state.worker_id, state.request_id, state.attempt)
            self.registry.release(state.worker_id, state.request_id)
            self.admission.wake()

    def _fail(self, state: RequestState, error: APIError) -> None:
        """Deliver an error to the request's handler (which then calls finish)."""
        if state.worker_id is not None:
            self.registry.release(state.worker_id, state.request_id)
        state.deliver(error)

    def _resubmit_or_fail(self, state: RequestState, error: APIError,
                          max_submits: int = MAX_SUBMITS) -> None:
        """The worker dropped the request: send it to another worker (the queue waits for
        one) with the tokens it produced so far, so the stream goes on where it stopped and
        the client sees a pause; `error` if it has been tried too often."""
        if state.num_submits >= max_submits or state.params is None:
            self._fail(state, error)
            return
        if state.num_received:
            self.metrics.on_failover()
        log.info("failover" if state.num_received else "resubmitting",
                 extra={"request_id": state.request_id, "worker_id": state.worker_id,
                        "num_output_tokens": state.num_received})
        if state.worker_id is not None:
            self.registry.release(state.worker_id, state.request_id)
        state.worker_id = None
        state.phase = RequestPhase.QUEUED
        task = asyncio.ensure_future(self._resubmit(state))
        self._resubmit_tasks.add(task)
        task.add_done_callback(self._resubmit_tasks.discard)
        state.resubmit_task = task

    async def _resubmit(self, state: RequestState) -> None:
        try:
            assert state.params is not None
            await self.submit(state, state.params)
        except APIError as e:
            if state.phase is not RequestPhase.DONE:
                state.deliver(e)

    # --- operator commands (called by gateway/http/admin.py) ---------------------------------

    def drain_worker(self, worker_id: str, deadline_s: float, exit_when_drained: bool) -> bool:
        """No new work to this worker; its streams finish within deadline_s or move on.
        `exit_when_drained`: a restart (the worker exits 0; its supervisor starts it)."""
        worker = self.registry.get(worker_id)
        if worker is None:
            return False
        worker.is_drain_requested = True
        worker.status = WorkerStatus.DRAINING
        log.info("draining worker on request", extra={"worker_id": worker_id,
                                                      "deadline_s": deadline_s,
                                                      "restart": exit_when_drained})
        return self.edge.send(worker_id, Drain(worker_id, deadline_s, exit_when_drained))

    def undrain_worker(self, worker_id: str) -> bool:
        worker = self.registry.get(worker_id)
        if worker is None:
            return False
        worker.is_drain_requested = False
        log.info("undraining worker on request", extra={"worker_id": worker_id})
        return self.edge.send(worker_id, Undrain(worker_id))

    # --- worker messages (called by the receive loops) ----------------------------------

    def _on_message(self, peer: Peer, msg: Message) -> None:
        if peer.user_id is not None and peer.worker_id not in (None, peer.user_id):
            # A keyed peer speaking as another worker (its key says who it is).
            self._warn_peer(f"a key issued for {peer.user_id!r} spoke as {peer.worker_id!r}")
            return
        if msg.TYPE is MsgType.HELLO:
            self._on_hello(peer, msg)
            return
        if peer.worker_id is None or self.registry.get(peer.worker_id) is None:
            if peer.route is not None:
                self._hail(peer.route)  # we restarted, or expired it: ask for a HELLO
            return
        handler = self._handlers.get(msg.TYPE)
        if handler is None:
            self._warn_peer(f"unexpected {type(msg).__name__} from a worker")
            return
        handler(peer.worker_id, msg)

    def _warn_peer(self, why: str) -> None:
        num_held = self._warn.allow(why)
        if num_held is not None:
            log.warning("dropped a message: %s", printable(why),
                        extra={"num_held_back": num_held})

    def _hello_refusal(self, peer: Peer, msg: Hello) -> str | None:
        if msg.protocol_version != PROTOCOL_VERSION:
            return (f"protocol version {msg.protocol_version} is not the gateway's "
                    f"{PROTOCOL_VERSION}")
        if peer.user_id is not None and msg.worker_id != peer.user_id:
            return f"this worker's key was issued for {peer.user_id!r}, not {msg.worker_id!r}"
        if self.edge.keys is None and not is_worker_id_valid(msg.worker_id):
            return f"bad worker id {msg.worker_id!r}"
        if self.models.model_of_worker(msg.served_model_name) is None:
            return (f"this gateway does not serve model {printable(msg.served_model_name)!r} "
                    f"(it serves: {', '.join(self.models.served)})")
        return None

    def _is_duplicate(self, peer: Peer, msg: Hello) -> bool:
        """A second live process with a worker's id (a copied key, a misconfiguration):
        refused while the first lives, else the two would replace each other every second,
        failing over every stream each time. The first is gone once its connection closed
        (a process that exits or is killed closes it at once: a restart is taken at once)
        or its heartbeats lapsed (expiry removes it); the second's next HELLO is taken then."""
        old = self.registry.get(msg.worker_id)
        if old is None or old.route == peer.route:
            return False
        probe = Heartbeat(worker_id=old.worker_id, time=time.time(), gateway_id=self.gateway_id)
        if not self.edge.is_connected(old.route, probe):
            return False
        why = (f"worker id {msg.worker_id!r} is taken by a live process (pid {old.hello.pid}); "
               "two processes must not share a worker id")
        if self._warn.allow(f"duplicate {msg.worker_id}") is not None:
            log.error("refused a second process with a live worker's id", extra={
                "worker_id": printable(msg.worker_id), "pid": msg.pid,
                "live_pid": old.hello.pid, "live_incarnation": old.incarnation})
        self.edge.send_route(peer.route, Error(None, "duplicate_worker_id", why))
        return True

    def _on_hello(self, peer: Peer, msg: Hello) -> None:
        assert peer.route is not None
        reason = self._hello_refusal(peer, msg)
        if reason is not None:
            log.error("refused worker", extra={"worker_id": printable(msg.worker_id),
                                               "reason": printable(reason)})
            self.edge.send_route(peer.route, Ready(False, reason,
                                                   self.config.heartbeat_interval_s,
                                                   self.gateway_id))
            return
        if self._is_duplicate(peer, msg):
            return
        worker_id = msg.worker_id
        model = self.models.model_of_worker(msg.served_model_name) or self.models.default
        old = self.registry.register(msg, peer.route, self.clock(), model)
        self.edge.bind_route(worker_id, peer.route)
        if old is not None:
            self.metrics.on_worker_event(worker_id, "restarted")
            self._fail_worker_requests(worker_id, "restarted")
        log.info("worker ready", extra={"worker_id": worker_id, "pid": msg.pid,
                                        "device": msg.device, "model": msg.model,
                                        "served_model_name": model,
                                        "version": msg.model_version,
                                        "max_model_len": msg.max_model_len,
                                        "num_kv_blocks": msg.num_kv_blocks})
        self._hailed_at.pop(peer.route, None)
        self.edge.send(worker_id, Ready(True, "", self.config.heartbeat_interval_s,
                                        self.gateway_id))
        self.admission.wake()

    def _on_heartbeat(self, worker_id: str, msg: Heartbeat) -> None:
        msg.worker_id = worker_id
        now = self.clock()
        worker = self.registry.on_heartbeat(msg, now)
        if worker is not None:
            self.metrics.on_worker_counters(worker_id, worker.route, msg.counters)
            self.reconciler.on_worker_report(worker, msg, now)
            self.admission.wake()

    def _hail(self, route: bytes) -> None:
        """A peer we do not know is talking (we restarted, or expired it): ask it for a
        HELLO, at most once a second, so that it learns at once whether its streams live."""
        now = self.clock()
        if now - self._hailed_at.get(route, -1e9) < 1.0:
            return
        if len(self._hailed_at) > 10_000:  # bounded: routes come from peers
            self._hailed_at.clear()
        self._hailed_at[route] = now
        self.edge.send_route(route, Heartbeat(worker_id="", state=UNKNOWN_WORKER,
                                              time=time.time(), gateway_id=self.gateway_id))

    def _on_drain(self, identity: str, msg: Drain) -> None:
        if self.registry.mark_draining(identity) is not None:
            log.info("worker draining", extra={"worker_id": identity})

    def _on_error(self, identity: str, msg: Error) -> None:
        log.error("worker error", extra={"worker_id": identity, "request_id": msg.request_id,
                                         "code": msg.code, "error": msg.message})
        state = self.streams.get(msg.request_id) if msg.request_id else None
        if state is not None and state.worker_id == identity and msg.attempt in (
                0, state.attempt):
            self._fail(state, server_error(f"The worker failed the request: {msg.message}"))

    def _on_tokens(self, worker_id: str, msg: Tokens) -> None:
        now = self.clock()
        self.registry.on_tokens(msg.worker_id, msg.seq, now)
        is_capacity_freed = False
        states = self.streams.states  # (its get, without the method call: once per output)
        for out in msg.outputs:
            state = states.get(out.request_id)
            if state is None:
                continue  # ended here already (aborted, stop string, lost worker)
            # (num_submits is state.attempt, read without the property: once per output.)
            if out.attempt != state.num_submits or state.worker_id != msg.worker_id:
                self._drop_stale(state, out, msg.worker_id)
                continue
            state.last_activity = now
            check = check_token_counts(state, out)
            if check is not TOKENS_OK:  # (a module name: see reconcile.TOKENS_OK)
                if check is TokenCheck.DUPLICATE:
                    continue
                if check is TokenCheck.GAP:
                    self._on_request_lost(state, "tokens from the worker were lost in transit")
                    is_capacity_freed = True
                    continue
                self._warn_peer(f"worker {worker_id!r} sent tokens beyond a stream's credit "
                                "or max_tokens (dropped)")  # TokenCheck.OVER_LIMIT
            if out.finish_reason is not None:
                self.registry.release(msg.worker_id, out.request_id)
                is_capacity_freed = True
                if out.finish_reason == "abort" and not out.new_token_ids:
                    # The worker stopped it (draining past its deadline, shutting down): not
                    # the request's fault, so it continues elsewhere.
                    self._resubmit_or_fail(state, worker_failed(
                        f"The worker stopped the request: {out.error or 'aborted'}"))
                    continue
                if out.finish_reason == "error" and state.num_received == 0 and \
                        not out.new_token_ids and out.error_code != POISON_REQUEST:
                    # Refused before any output (a worker-side failure): worth one more
                    # try, likely on another worker.
                    self._resubmit_or_fail(state, server_error(
                        f"The worker failed the request: {out.error or 'unknown error'}"),
                        MAX_SUBMITS_AFTER_ERROR)
                    continue
            state.num_received += len(out.new_token_ids)
            state.output_token_ids.extend(out.new_token_ids)
            state.sink.put_nowait((state, out))  # (state.deliver(out), inlined)
        if is_capacity_freed:
            self.admission.wake()

    def _drop_stale(self, state: RequestState, out: TokenOutput, worker_id: str) -> None:
        """An output of an attempt the stream has left behind (still in flight when it moved,
        from this worker or another, or from a dead process of the same worker id): it
        counts for nothing, however late it comes."""
        self.metrics.on_stale_output()
        log.debug("stale output dropped", extra={
            "request_id": state.request_id, "worker_id": worker_id, "attempt": out.attempt,
            "current_attempt": state.attempt, "num_output_tokens": out.num_output_tokens})

    # --- liveness ---------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        while True:
            expected = self.clock() + interval
            await asyncio.sleep(interval)
            try:
                self._beat(lag_s=max(0.0, self.clock() - expected))
                self.reconciler.check_idle(self.clock())
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
            self._on_worker_lost(worker, "went silent (no heartbeat)",
                                 silent_s=round(now - worker.last_seen, 3))
        for worker_id in list(self.registry.workers):
            self.edge.send(worker_id, Heartbeat(worker_id=worker_id, time=time.time(),
                                                gateway_id=self.gateway_id))

    def worker_exited(self, worker_id: str, pid: int, what: str) -> bool:
        """The process `pid` of this worker exited, its supervisor says (gateway/http/admin.py):
        lost now, its streams move on as on heartbeat expiry, without waiting for its
        heartbeats to lapse. False (nothing done) if `pid` is not the process registered
        under that id: a late notice about an older incarnation spares its successor."""
        worker = self.registry.remove_exited(worker_id, pid, self.clock(), what)
        if worker is None:
            return False
        self._on_worker_lost(worker, what, event="exited")
        return True

    def _on_worker_lost(self, worker: WorkerHandle, what: str, event: str = "lost",
                        **extra: Any) -> None:
        log.error("worker lost: it %s", what, extra={
            "worker_id": worker.worker_id, "num_in_flight": len(worker.request_ids), **extra})
        self.metrics.on_worker_event(worker.worker_id, event)
        self._fail_worker_requests(worker.worker_id, what)
        self.edge.unbind(worker.worker_id)

    def _on_request_lost(self, state: RequestState, why: str) -> None:
        """A message of this request was lost (SUBMIT, final TOKENS, tokens mid-stream) or
        it idled past its deadline: end it on its worker, then retry or fail it."""
        log.warning("request lost: %s", why, extra={"request_id": state.request_id,
                                                     "worker_id": state.worker_id})
        if state.worker_id is not None:
            self.outbox.abort(state.worker_id, state.request_id, state.attempt)
        self._resubmit_or_fail(state, worker_failed(f"The request was lost: {why}; please "
                                                    "retry."))

    def _on_request_idle(self, state: RequestState, idle_s: float) -> None:
        log.warning("request idle: no output for %.0fs", idle_s,
                    extra={"request_id": state.request_id, "worker_id": state.worker_id})
        if state.worker_id is not None:
            self.outbox.abort(state.worker_id, state.request_id, state.attempt)
        self._fail(state, request_timeout(
            f"The worker produced no output for {idle_s:.0f}s; the request was aborted."))

    def _fail_worker_requests(self, worker_id: str, what: str) -> None:
        for state in self.streams.on_worker(worker_id):
            self._resubmit_or_fail(state, worker_failed(
                f"The worker serving this request ({worker_id}) {what}; please retry."))


class _RandomBytes:
    """os.urandom's bytes, read 4 KiB at a time: one getrandom() system call per 256 ids
    made per request instead of one per id (issue 36). Thread-safe (the CPU pool makes ids
    too); emptied in a forked child, so two processes never hand out the same bytes."""

    _CHUNK = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buf = b""
        self._pos = 0

    def take(self, n: int) -> bytes:
        with self._lock:
            pos = self._pos
            if pos + n > len(self._buf):
                self._buf, pos = os.urandom(self._CHUNK), 0
            self._pos = pos + n
            return self._buf[pos:pos + n]

    def clear(self) -> None:
        self._buf, self._pos = b"", 0
        self._lock = threading.Lock()  # (one held by another thread at the fork stays held)


_RANDOM_BYTES = _RandomBytes()
os.register_at_fork(after_in_child=_RANDOM_BYTES.clear)


def random_hex() -> str:
    """32 random hex digits, as uuid.uuid4().hex has them (122 random bits there, 128 here),
    for ids made per request: the kernel's random bytes, without uuid4's UUID object or a
    system call per id."""
    return _RANDOM_BYTES.take(16).hex()


def _one_model(config: GatewayConfig) -> ModelCatalog:
    """A gateway built without a catalog serves its config's one model, under its served
    name and its file's display name."""
    display = model_display_name(config.model)
    name = config.served_model_name or display
    return ModelCatalog(name, {name: name, display: name})
