"""The worker process: one Engine behind two ZeroMQ sockets.

The engine thread runs the loop: receive, then schedule + execute + update
(`engine.step_overlapped()`), which emits the previous step's outputs while the device
computes. Socket I/O stays at the edges: a link thread owns the DEALER (gateway commands in,
HELLO/DRAIN/heartbeats out) so heartbeats keep their pace while a long step runs, and a
sender thread per gateway puts the TOKENS messages (one per step) on its PUSH socket.

Flow control: each stream has a credit (the window the gateway granted, plus later grants,
minus tokens sent). At 0 the stream is paused in the engine (it keeps its KV blocks and
leaves the batch) until CREDIT arrives, so no more than a window of a stream's tokens is
ever in flight.

Lifecycle: HELLO -> READY -> serve. SIGTERM or a gateway DRAIN: tell the gateway, refuse
new work, finish in-flight requests within the drain timeout, fail the rest, exit 0.

A silent gateway is a pause, not a failure: after `gateway_timeout_s` of silence the worker
says HELLO again (a restarted gateway learns of it) but keeps its streams, which stop at
their credit, for `gateway_grace_s`; only then are they failed and their KV freed. A gateway
that answers with another `gateway_id` is a new process: the old streams are dropped at
once. The gateway reconciles the rest from the request ids each heartbeat carries.

Several gateways (`zeroserve serve --gateways N`): the worker links to each (one DEALER and
one PUSH per gateway, worker/link.py) and remembers which gateway each stream came from.
A stream's TOKENS go only to its gateway, and only its gateway's SUBMIT, CREDIT and ABORT
touch it; each gateway's heartbeats list only its own streams (with the worker's whole
load). So silence, a restart or the grace period of one gateway ends only that gateway's
streams, and the others go on.

Gateways found by DNS (`--gateway-dns`, worker/discovery.py): the set of gateways changes
while the worker runs. A new address gets a link (and a HELLO); a link whose address left
the answer is retired: it gets no new HELLO and is closed once it holds no stream of ours,
or at once (failing its streams) when it is also silent past `gateway_timeout_s`: gone from
DNS and silent, that gateway is gone. A draining gateway that still talks keeps its streams
to the end. Links are keyed by an index that is never reused.

Health means progress: the link thread stamps every heartbeat with how long ago the engine
thread last finished a loop iteration; a worker stuck for `stall_timeout_s` exits non-zero
(its supervisor or container runtime restarts it), and so does one whose steps fail
`max_step_failures` times in a row.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from zeroserve.common.keys import load_worker_keys
from zeroserve.common.protocol import (
    PROTOCOL_VERSION,
    UNKNOWN_WORKER,
    Abort,
    Credit,
    Drain,
    Error,
    Heartbeat,
    Hello,
    Message,
    Ready,
    Shutdown,
    Submit,
    TokenOutput,
    Tokens,
    Undrain,
    WorkerState,
    encode,
)
from zeroserve.worker.config import WorkerConfig
from zeroserve.worker.debug import WorkerDebug
from zeroserve.worker.discovery import GatewayDiscovery, GatewaysFound, Resolver
from zeroserve.worker.engine import StepFailed
from zeroserve.worker.grammar import GrammarSpec
from zeroserve.worker.kv_tier.identity import hello_fields
from zeroserve.worker.kv_tier.store import kv_tier_counters
from zeroserve.worker.link import GatewayPeer, LinkState, new_route
from zeroserve.worker.output_rows import to_wire
from zeroserve.worker.outputs import RequestOutput
from zeroserve.worker.sequence import RequestError, SamplingParams
from zeroserve.worker.speculative import spec_decode_counters

if TYPE_CHECKING:
    from zeroserve.worker.engine import Engine

log = logging.getLogger("zeroserve.worker")

# Exit codes. A supervisor restarts on any of them; 3 means "fix the configuration".
EXIT_OK = 0  # drained, or told to shut down
EXIT_ENGINE_FAILED = 1  # a step raised; in-flight requests were failed first
EXIT_REFUSED = 3  # the gateway refused our HELLO (e.g. another protocol version)
# 4 (worker.link.EXIT_STALLED): the engine thread made no progress for stall_timeout_s.


def run_worker(config: WorkerConfig, engine: Engine | None = None,
               resolver: Resolver | None = None) -> int:
    """Load the model (unless an engine is given, as tests do), serve until told to stop.
    `resolver` replaces DNS for `config.gateway_dns` (tests).

    Returns the process exit code (EXIT_*).
    """
    if engine is None:
        engine = build_engine(config)
    return WorkerLoop(config, engine, resolver).run()


def build_engine(config: WorkerConfig) -> Engine:
    if config.engine.num_threads is not None:
        import torch

        torch.set_num_threads(config.engine.num_threads)
    from zeroserve.worker.engine import Engine

    runner = None
    if config.backend == "fake":
        from zeroserve.worker.fake_runner import FakeRunner

        # Plan checks simulate the KV cache at O(context) per step: right for engine tests,
        # too slow for a server that streams long outputs.
        runner = FakeRunner(config.engine, forward_time_s=config.fake_forward_s,
                            stamps_path=config.fake_stamps_path,
                            check_plans=False)
    started = time.monotonic()
    engine = Engine(config.engine, runner=runner)
    log.info("engine ready", extra={"worker_id": config.worker_id, "backend": config.backend,
                                    "load_s": round(time.monotonic() - started, 2)})
    from zeroserve.common.gc_tuning import tune_for_serving

    tune_for_serving()  # this process is a worker from now on (its start-up heap is done)
    return engine


class _Wake:
    """Put in the inbox by another thread (worker/grammar_pending.py): it only wakes us."""


_WAKE = _Wake()


@dataclass(slots=True)
class _Stream:
    credit_limit: int  # output tokens we may have sent in all (a high-water mark)
    gateway: int = 0  # the index of the gateway (GatewayPeer) whose client reads it
    attempt: int = 1  # the SUBMIT's attempt, echoed by every output (Submit.attempt)
    num_sent: int = 0
    is_paused: bool = False  # paused in the engine by us for lack of credit

    @property
    def has_credit(self) -> bool:
        return self.num_sent < self.credit_limit


class WorkerLoop:
    """The engine thread's loop. One instance per process run."""

    def __init__(self, config: WorkerConfig, engine: Engine, resolver: Resolver | None = None):
        self.config = config
        self.engine = engine
        self.state = WorkerState.STARTING
        self.streams: dict[str, _Stream] = {}
        # Request id -> ABORT outputs still to come (the next step reports them) from engine
        # requests we dropped; stale, they must not end a new SUBMIT of the same id.
        self._stale_aborts: dict[str, int] = {}
        self.num_steps = 0
        # One per gateway address pair, keyed by an index never reused (from run(), and
        # from discovery). Every stream's gateway is in it.
        self.gateways: dict[int, GatewayPeer] = {}
        self._retired: set[int] = set()  # links whose address left the DNS answer
        self._next_index = 0
        self._resolver = resolver
        # From every link: (its index, message); from other threads: (None, message).
        self._inbox: queue.Queue[tuple[int | None, Message]] = queue.Queue()
        self._num_failed_steps = 0  # in a row
        self._ids_at = time.monotonic()  # when the streams snapshot for heartbeats was valid
        self.exit_code: int | None = None  # set when the loop should end
        # Outputs made outside a step (rejections, aborts), as (gateway index, output).
        self._pending: list[tuple[int, TokenOutput]] = []
        self._drain_deadline: float | None = None
        self._exit_when_drained = False
        self._num_signals = 0
        self._first_signal_at = 0.0
        self._is_last_step_empty = False
        self._log_extra = {"worker_id": config.worker_id}
        self._handlers = {
            Ready: self._on_ready, Submit: self._on_submit, Abort: self._on_abort,
            Credit: self._on_credit, Drain: self._on_drain, Shutdown: self._on_shutdown,
            Heartbeat: self._on_heartbeat, Error: self._on_error, Undrain: self._on_undrain,
            _Wake: lambda gw, msg: None, GatewaysFound: self._on_gateways_found,
        }
        # A request's grammar compiled off this thread: end the loop's wait for messages.
        engine.wake = lambda: self._inbox.put((None, _WAKE))
        # Stacks, profiles, memory: answered by the link threads (worker/debug.py); only
        # the torch profiler needs this thread (debug.torch.tick() in the loop).
        self.debug = WorkerDebug(config.worker_id, engine.wake)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        ctx = zmq.Context()
        keys = (None if self.config.keys_dir is None
                else load_worker_keys(self.config.keys_dir, self.config.worker_id))
        self._ctx, self._keys = ctx, keys
        self._route = new_route(self.config.worker_id)  # one per process, for every gateway
        for router, tokens in self.config.gateway_endpoints:
            self._add_gateway(router, tokens, say_hello=False)
        discovery = None
        if self.config.gateway_dns is not None:
            discovery = GatewayDiscovery(self.config.gateway_dns, self._inbox,
                                         self.config.worker_id, self._resolver)
            discovery.start()
        restore_signals = self._install_signal_handlers()
        try:
            self._publish_load()
            for gw in self.gateways.values():
                self._say_hello(gw)
            while self.exit_code is None:
                # Every SUBMIT the link thread took before this moment is in self.streams
                # after _receive, so the snapshot published below holds it (until it ends).
                ids_at = time.monotonic()
                self._receive(self._receive_timeout())
                self._check_signals()
                self._check_gateway()
                self._check_drain()
                self._ids_at = ids_at
                self._step()  # publishes the load once its emit is done
                self.debug.torch.tick()
                progress_at = time.monotonic()
                for gw in self.gateways.values():
                    gw.link.progress_at = progress_at
            self._emit(self.engine.take_outputs())
        finally:
            restore_signals()
            if discovery is not None:
                discovery.stop()
            for gw in self.gateways.values():
                gw.request_stop()
            for gw in self.gateways.values():
                gw.close()
            ctx.term()
        log.info("worker exiting", extra={**self._log_extra, "exit_code": self.exit_code})
        return self.exit_code

    def _has_work(self) -> bool:
        engine = self.engine
        return ((any(not s.is_paused for s in self.streams.values())
                 and engine.has_unfinished()) or engine.has_admissions()
                or engine.has_launched_step())

    def _step(self) -> None:
        """One engine step. Its outputs go out during the next step's device time (or at once
        when no step follows): `_emit` runs inside the engine's step."""
        if not self._has_work():
            # The last step's outputs (no step to wait for) and what was rejected here.
            self._emit_and_publish(self.engine.take_outputs())
            return
        self.num_steps += 1
        try:
            self.engine.step_overlapped(self._emit_and_publish)
        except StepFailed as e:  # nothing of the step ran: its requests may run elsewhere
            log.error("engine step failed (%d in a row): %s", self._num_failed_steps + 1, e,
                      extra=self._log_extra)
            for rid in e.request_ids:
                stream = self.streams.get(rid)
                if stream is not None:
                    self._drop(rid)
                    self._reject(stream.gateway, rid, "the worker failed to run the step",
                                 stream.attempt, retryable=True)
            self._on_failed_step("the worker's steps keep failing")
            self._emit_and_publish(self.engine.take_outputs())
            return
        except Exception as e:  # the batch's state is suspect: fail what it holds
            log.exception("engine step failed (%d in a row)", self._num_failed_steps + 1,
                          extra=self._log_extra)
            self._fail_all(f"internal error in the worker: {e}")
            self._on_failed_step(f"internal error in the worker: {e}")
            self._emit_and_publish([])
            return
        self._is_last_step_empty = self.engine.last_step.num_seqs == 0
        if not self._is_last_step_empty:  # a step that ran something ends a failing streak
            self._num_failed_steps = 0

    def _on_failed_step(self, message: str) -> None:
        """Count a failed step; at max_step_failures in a row, hand every stream back and
        exit (the supervisor or the container runtime starts a new process)."""
        self._num_failed_steps += 1
        if self._num_failed_steps >= self.config.max_step_failures:
            log.error("engine failed %d steps in a row; exiting", self._num_failed_steps,
                      extra=self._log_extra)
            self._fail_all(message)
            self.exit_code = EXIT_ENGINE_FAILED

    def _emit_and_publish(self, outputs: list[RequestOutput]) -> None:
        """The emit, then the heartbeats' load (the streams just ended are out of it). In a
        step this runs during the device time."""
        self._emit(outputs)
        self._publish_load()

    def _receive_timeout(self) -> float:
        """How long to wait for messages: not at all while there is work; a moment when the
        last step ran nothing (dynamic batching gathering arrivals); else until the next
        housekeeping tick, asleep in the queue (no spinning)."""
        if not self._has_work():
            return self.config.heartbeat_interval_s
        return 0.001 if self._is_last_step_empty else 0.0

    def _receive(self, timeout: float) -> None:
        try:
            index, msg = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            handler = self._handlers.get(type(msg))
            gw = None if index is None else self.gateways.get(index)
            if handler is None:
                log.warning("ignored a %s from the gateway", type(msg).__name__,
                            extra=self._log_extra)
            elif gw is not None or index is None:  # else: from a link closed since
                handler(gw, msg)
            try:
                index, msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """One TOKENS message per gateway that has news this step: its own streams only."""
        # Once per stream per step: locals, and the stream's fields read once.
        wire: dict[int, list] = {index: [] for index in self.gateways}  # rows per gateway
        for index, row in self._pending:
            if index in wire:  # else: a link closed since
                wire[index].append(row)
        self._pending = []
        streams = self.streams
        stale_aborts = self._stale_aborts
        for out in outputs:
            (rid, new_token_ids, reason, num_prompt, num_output, num_cached, logprobs,
             prompt_logprobs, error, timings, error_code) = out
            is_finished = reason is not None
            if is_finished and rid in stale_aborts:
                self._take_stale_abort(rid)
                continue  # a dropped incarnation's abort (it comes before a new one's)
            stream = streams.get(rid)
            if stream is None:
                continue  # the gateway aborted it already and forgot it
            if (logprobs is None and prompt_logprobs is None and timings is None
                    and error_code is None):  # most rows: no conversion, no calls
                row = [rid, new_token_ids, None if reason is None else reason.value,
                       num_prompt, num_output, num_cached, None, error, None, None,
                       stream.attempt]
            else:
                row = to_wire(out, stream.attempt)
            wire[stream.gateway].append(row)
            num_sent = stream.num_sent = stream.num_sent + len(new_token_ids)
            if is_finished:
                del streams[rid]
            elif num_sent >= stream.credit_limit and not stream.is_paused:  # out of credit
                stream.is_paused = self.engine.pause(rid)
        for index, rows in wire.items():
            if rows:
                gw = self.gateways[index]
                gw.tokens_seq += 1
                gw.send_tokens(Tokens(self.config.worker_id, self.num_steps, rows,
                                      gw.tokens_seq))

    # -- message handlers -------------------------------------------------------------------

    def _on_ready(self, gw: GatewayPeer, msg: Ready) -> None:
        if not msg.accepted:
            log.error("the gateway refused this worker: %s", msg.reason, extra=self._log_extra)
            self._fail_all("the gateway refused this worker")
            self.exit_code = EXIT_REFUSED
            return
        if msg.gateway_id != gw.gateway_id:
            self._on_new_gateway(gw, msg.gateway_id)
        if gw.state is not LinkState.CONNECTED:
            log.info("connected to the gateway", extra={**self._log_extra, "gateway": gw.index,
                                                        "gateway_id": msg.gateway_id})
        gw.state = LinkState.CONNECTED
        if self.state is WorkerState.STARTING:
            self.state = WorkerState.READY

    def _on_submit(self, gw: GatewayPeer, msg: Submit) -> None:
        rid = msg.request_id
        stream = self.streams.get(rid)
        # (Another gateway's stream of the same id: the engine refuses the duplicate below.)
        if (stream is not None and stream.gateway == gw.index
                and self._on_repeated_submit(gw, msg, stream)):
            return
        if self.state is WorkerState.DRAINING:
            self._reject(gw.index, rid, "worker is draining; retry on another worker",
                         msg.attempt, retryable=True)
            return
        try:
            params = _sampling_params(msg.params)
            grammar = None if msg.grammar is None else GrammarSpec.from_wire(msg.grammar)
            self.engine.add_request(rid, msg.prompt_token_ids, params, msg.output_token_ids,
                                    grammar=grammar, priority=msg.priority,
                                    flow=msg.flow)
        except (RequestError, TypeError, ValueError) as e:
            self._reject(gw.index, rid, str(e), msg.attempt,
                         num_prompt_tokens=len(msg.prompt_token_ids))
            return
        except Exception as e:  # an engine bug must not take the other streams down
            log.exception("add_request failed", extra={**self._log_extra, "request_id": rid})
            self._reject(gw.index, rid, f"internal error: {e}", msg.attempt,
                         num_prompt_tokens=len(msg.prompt_token_ids))
            return
        stream = self.streams[rid] = _Stream(credit_limit=msg.credit, gateway=gw.index,
                                             attempt=msg.attempt,
                                             num_sent=len(msg.output_token_ids))
        self.engine.set_credit_limit(rid, stream.credit_limit)  # speculative drafts stop there
        if not stream.has_credit:
            # A failover of a stream whose client read nothing of its last window: the
            # gateway holds a window already. Paused before its first step, or that step's
            # token would go out past the limit (and be dropped there, a gap).
            stream.is_paused = self.engine.pause(rid)
        log.debug("request added", extra={**self._log_extra, "request_id": rid,
                                          "num_prompt_tokens": len(msg.prompt_token_ids)})

    def _on_repeated_submit(self, gw: GatewayPeer, msg: Submit, stream: _Stream) -> bool:
        """A SUBMIT of a request we hold: the gateway thought it lost (its SUBMIT, or this
        worker for a while: a cut link). True if handled. Where the gateway's stream is
        where ours is, take its credit and go on; where tokens we sent never reached it,
        drop ours and start over from what it has (the caller adds it anew)."""
        rid = msg.request_id
        if stream.num_sent == len(msg.output_token_ids):
            log.info("repeated SUBMIT: continuing", extra={**self._log_extra, "request_id": rid,
                                                           "attempt": msg.attempt})
            stream.attempt = msg.attempt  # what it sends from now on is the new attempt's
            self._on_credit(gw, Credit([[rid, msg.credit]]))
            return True
        log.info("repeated SUBMIT: restarting from the gateway's %d tokens (we sent %d)",
                 len(msg.output_token_ids), stream.num_sent,
                 extra={**self._log_extra, "request_id": rid})
        self._drop(rid)
        return False

    def _drop(self, rid: str) -> None:
        """End a request in the engine now and forget its stream."""
        if self.engine.abort(rid):
            self._stale_aborts[rid] = self._stale_aborts.get(rid, 0) + 1
        self.streams.pop(rid, None)

    def _take_stale_abort(self, rid: str) -> None:
        num_left = self._stale_aborts.pop(rid) - 1
        if num_left:
            self._stale_aborts[rid] = num_left

    def _on_abort(self, gw: GatewayPeer, msg: Abort) -> None:
        attempts = msg.attempts or [0] * len(msg.request_ids)
        for rid, attempt in zip(msg.request_ids, attempts, strict=True):
            stream = self.streams.get(rid)
            if stream is not None:
                if stream.gateway != gw.index:
                    continue  # another gateway's stream: only its own gateway ends it
                if attempt and attempt != stream.attempt:
                    continue  # a late ABORT of an attempt this stream has left behind
                log.debug("request aborted", extra={**self._log_extra, "request_id": rid})
            self._drop(rid)

    def _on_credit(self, gw: GatewayPeer, msg: Credit) -> None:
        for grant in msg.grants:
            rid, limit = grant[0], grant[1]
            stream = self.streams.get(rid)
            if stream is None or stream.gateway != gw.index or (
                    len(grant) == 3 and grant[2] != stream.attempt):
                continue  # finished while the credit was on its way (or not this gateway's)
            stream.credit_limit = max(stream.credit_limit, limit)  # old or repeated: no-op
            self.engine.set_credit_limit(rid, stream.credit_limit)
            if stream.is_paused and stream.has_credit:
                self.engine.resume(rid)
                stream.is_paused = False

    def _on_drain(self, gw: GatewayPeer, msg: Drain) -> None:
        self._begin_drain(msg.deadline_s, tell_gateway=False,
                          exit_when_drained=msg.exit_when_drained)
        self._beat_now()

    def _on_undrain(self, gw: GatewayPeer, msg: Undrain) -> None:
        if self.state is not WorkerState.DRAINING or self._exit_when_drained:
            return  # a drain that ends in an exit (SIGTERM, restart) is not called off
        log.info("undrained: taking new work again", extra=self._log_extra)
        self.state = WorkerState.READY
        self._drain_deadline = None
        self._publish_load()
        self._beat_now()

    def _beat_now(self) -> None:
        """Tell every gateway the new state at once. A gateway that asked for a drain shows
        it until a heartbeat says "draining" (gateway/workers/registry.py); with
        `serve --gateways N`, an undrain through another gateway that reached the worker
        before its next periodic beat left the asking one showing the drain for good. A beat
        sent now reaches each gateway ahead of anything the worker says after it."""
        for gw in self.gateways.values():
            gw.beat_now()

    def _on_shutdown(self, gw: GatewayPeer, msg: Shutdown) -> None:
        log.info("shutdown requested by the gateway: %s", msg.reason, extra=self._log_extra)
        self._fail_all(f"worker shut down ({msg.reason or 'gateway request'})")
        self.exit_code = EXIT_OK

    def _on_heartbeat(self, gw: GatewayPeer, msg: Heartbeat) -> None:
        # Liveness is tracked by the link thread for every message; here: who is speaking.
        if msg.gateway_id and gw.gateway_id is not None and msg.gateway_id != gw.gateway_id:
            self._on_new_gateway(gw, msg.gateway_id)
        elif msg.state == UNKNOWN_WORKER and gw.state is LinkState.CONNECTED:
            log.warning("the gateway does not know this worker; saying HELLO again",
                        extra={**self._log_extra, "gateway": gw.index})
        else:
            return
        gw.state = LinkState.CONNECTING
        self._say_hello(gw)

    def _on_new_gateway(self, gw: GatewayPeer, gateway_id: str) -> None:
        """Another gateway process: nobody reads the old one's streams any more."""
        if gw.gateway_id is not None:
            num_streams = self._num_streams_of(gw)
            if num_streams:
                log.warning("the gateway restarted; dropping %d streams of the old one",
                            num_streams, extra={**self._log_extra, "gateway": gw.index})
                self._fail_all("the gateway restarted", gw)
        gw.gateway_id = gateway_id

    def _num_streams_of(self, gw: GatewayPeer) -> int:
        if len(self.gateways) == 1:
            return len(self.streams)
        return sum(1 for s in self.streams.values() if s.gateway == gw.index)

    def _on_error(self, gw: GatewayPeer, msg: Error) -> None:
        log.warning("gateway error %s: %s", msg.code, msg.message,
                    extra={**self._log_extra, "request_id": msg.request_id})

    # -- housekeeping -----------------------------------------------------------------------

    def _say_hello(self, gw: GatewayPeer) -> None:
        info = self.engine.info
        hello = Hello(
            protocol_version=PROTOCOL_VERSION, worker_id=self.config.worker_id,
            model=info.name,
            # The engine's limit also counts the KV pool (a sequence must fit it alone).
            max_model_len=getattr(self.engine, "max_model_len", info.max_model_len),
            num_kv_blocks=self.engine.stats().num_total_blocks,
            block_size=self.config.engine.block_size,
            max_num_seqs=self.config.engine.max_num_seqs, device=info.device, pid=os.getpid(),
            startup_phases=dict(getattr(self.engine, "startup_phases", {})),
            served_model_name=self.config.served_model_name,
            model_version=self.config.model_version,
            **hello_fields(getattr(self.engine, "tier", None)),
        )
        gw.link.hello_sent_at = None  # so the next check waits for this HELLO's fate
        gw.send_control(encode(hello))

    def _check_gateway(self) -> None:
        for gw in list(self.gateways.values()):
            if gw.index in self._retired:
                self._check_retired(gw)
            else:
                self._check_one_gateway(gw)

    def _check_one_gateway(self, gw: GatewayPeer) -> None:
        """Silence of one gateway touches only its own streams."""
        now = time.monotonic()
        timeout = self.config.gateway_timeout_s
        silent_s = now - gw.link.last_heard
        extra = {**self._log_extra, "gateway": gw.index}
        if silent_s > self.config.gateway_grace_s:
            num_streams = self._num_streams_of(gw)
            if num_streams:
                log.warning("gateway silent for %.1fs; failing %d in-flight requests",
                            silent_s, num_streams, extra=extra)
                self._fail_all("lost contact with the gateway", gw)
        if gw.state is LinkState.CONNECTED and silent_s > timeout:
            # Maybe only its event loop is busy; maybe it restarted. Keep the streams (they
            # stop at their credit) and say HELLO: the answer tells which.
            log.warning("gateway silent for %.1fs; keeping %d streams for up to %.0fs and "
                        "saying HELLO again", silent_s, self._num_streams_of(gw),
                        self.config.gateway_grace_s, extra=extra)
            gw.state = LinkState.CONNECTING
            self._say_hello(gw)
        elif gw.state is LinkState.CONNECTING:
            # A HELLO that reached a gateway and got no READY: that gateway may have died
            # with it. (One still waiting for a connection is retried by the link thread.)
            sent_at = gw.link.hello_sent_at
            if sent_at is not None and now - sent_at > timeout:
                self._say_hello(gw)

    # -- gateways found by DNS --------------------------------------------------------------

    def _add_gateway(self, router: str, tokens: str, say_hello: bool = True) -> GatewayPeer:
        index = self._next_index
        self._next_index += 1
        gw = GatewayPeer(self._ctx, self.config, self._route, index, router, tokens,
                         self._keys, self._inbox, self.debug)
        self.gateways[index] = gw
        gw.start()
        if say_hello:
            self._publish_load()  # its heartbeats need a load before they start
            self._say_hello(gw)
        return gw

    def _on_gateways_found(self, gw: None, msg: GatewaysFound) -> None:
        """The latest DNS answer: link to new addresses, retire the links of vanished ones
        (closed by _check_retired once they hold no stream of ours)."""
        wanted = set(msg.endpoints)
        have = {peer.endpoints: index for index, peer in self.gateways.items()}
        for endpoints in sorted(wanted - have.keys()):
            peer = self._add_gateway(*endpoints)
            log.info("linking to a gateway found by DNS", extra={
                **self._log_extra, "gateway": peer.index, "router_address": endpoints[0]})
        for endpoints, index in have.items():
            if endpoints in wanted:
                self._retired.discard(index)  # back in the answer (or never gone)
            elif index not in self._retired:
                self._retired.add(index)
                log.info("a gateway left the DNS answer; its link ends with its last stream",
                         extra={**self._log_extra, "gateway": index,
                                "router_address": endpoints[0]})

    def _check_retired(self, gw: GatewayPeer) -> None:
        """A link whose address left the DNS answer. A draining gateway still talks: its
        streams finish there. Gone from DNS and silent too, that gateway is gone."""
        silent_s = time.monotonic() - gw.link.last_heard
        if self._num_streams_of(gw) and silent_s > self.config.gateway_timeout_s:
            log.warning("gateway gone (not in DNS, silent %.1fs); failing %d streams",
                        silent_s, self._num_streams_of(gw),
                        extra={**self._log_extra, "gateway": gw.index})
            self._fail_all("lost contact with the gateway", gw)
            self._emit([])  # the gateway may yet hear it; before its link closes
        if not self._num_streams_of(gw):
            self._close_gateway(gw)

    def _close_gateway(self, gw: GatewayPeer) -> None:
        del self.gateways[gw.index]
        self._retired.discard(gw.index)
        gw.request_stop()
        gw.close()
        log.info("link to a gateway closed", extra={**self._log_extra, "gateway": gw.index})

    def _begin_drain(self, deadline_s: float, tell_gateway: bool,
                     exit_when_drained: bool = True) -> None:
        """No new work; streams get `deadline_s` to finish, then move to another worker.
        A drain that ends in an exit (SIGTERM, a restart) wins over one that does not."""
        deadline = time.monotonic() + deadline_s
        self._exit_when_drained = self._exit_when_drained or exit_when_drained
        if self._drain_deadline is not None:
            self._drain_deadline = min(self._drain_deadline, deadline)
            return
        log.info("draining: %d requests in flight, deadline %.1fs%s", len(self.streams),
                 deadline_s, ", then exiting" if self._exit_when_drained else "",
                 extra=self._log_extra)
        self.state = WorkerState.DRAINING
        self._drain_deadline = deadline
        self._publish_load()  # heartbeats say "draining" from now on, before the DRAIN
        if tell_gateway:
            for gw in self.gateways.values():
                gw.send_control(encode(Drain(self.config.worker_id, deadline_s)))

    def _check_drain(self) -> None:
        if self._drain_deadline is None:
            return
        if self.streams and time.monotonic() >= self._drain_deadline:
            log.warning("drain deadline: handing %d unfinished requests back to the gateway",
                        len(self.streams), extra=self._log_extra)
            self._fail_all("worker drained before the request finished (drain deadline)")
        if not self.streams and self._exit_when_drained:
            log.info("drained", extra=self._log_extra)
            self.exit_code = EXIT_OK

    def _fail_all(self, message: str, gw: GatewayPeer | None = None) -> None:
        """Abort every stream (of gateway `gw`, or of all) in the engine and tell its gateway
        each one stopped here (with finish reason "abort": not the request's fault, so it
        may continue elsewhere)."""
        for rid, stream in list(self.streams.items()):
            if gw is None or stream.gateway == gw.index:
                self._drop(rid)
                self._reject(stream.gateway, rid, message, stream.attempt, retryable=True)

    def _reject(self, gateway: int, request_id: str, message: str, attempt: int,
                num_prompt_tokens: int = 0, retryable: bool = False) -> None:
        """Tell gateway number `gateway` that attempt `attempt` of a request ended here:
        "abort" if another worker may take it on (draining, shutting down), "error" if the
        request itself failed."""
        reason = "abort" if retryable else "error"
        self._pending.append((gateway, TokenOutput(request_id, [], reason, num_prompt_tokens,
                                                   0, error=message, attempt=attempt)))
        log.info("request failed: %s", message,
                 extra={**self._log_extra, "request_id": request_id})

    def _publish_load(self) -> None:
        """Each gateway's next heartbeats: the worker's whole load (every gateway routes on
        it), but only that gateway's request ids (it reconciles those)."""
        stats = self.engine.stats()
        if len(self.gateways) == 1:
            ids_by_gateway = {index: list(self.streams) for index in self.gateways}
            attempts_by_gateway = {index: [s.attempt for s in self.streams.values()]
                                   for index in self.gateways}
        else:
            ids_by_gateway = {index: [] for index in self.gateways}
            attempts_by_gateway = {index: [] for index in self.gateways}
            for rid, stream in self.streams.items():
                ids_by_gateway[stream.gateway].append(rid)
                attempts_by_gateway[stream.gateway].append(stream.attempt)
        counters = {"prefix_cache_queries": stats.num_prefix_queries,
                    "prefix_cache_hits": stats.num_prefix_hits,
                    "num_preemptions": stats.num_preemptions,
                    **spec_decode_counters(stats.spec_decode),
                    **kv_tier_counters(stats.kv_tier)}
        for index, request_ids in ids_by_gateway.items():
            gw = self.gateways[index]
            attempts = attempts_by_gateway[index]
            gw.link.load = (Heartbeat(
                worker_id=self.config.worker_id, state=self.state.value,
                num_running=stats.num_running, num_waiting=stats.num_waiting,
                num_paused=stats.num_paused, num_free_blocks=stats.num_free_blocks,
                num_total_blocks=stats.num_total_blocks, num_steps=self.num_steps,
                request_ids=request_ids, counters=counters, request_attempts=attempts,
                tokens_seq=gw.tokens_seq,
            ), self._ids_at)

    # -- signals ----------------------------------------------------------------------------

    def _install_signal_handlers(self):
        """SIGTERM/SIGINT: drain; a second one: stop now. Only possible on the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore

    def _on_signal(self, signum: int, frame: object) -> None:
        # Only count here; the loop acts on it (handlers must not touch sockets or the engine).
        # A repeat within a second is one event delivered twice (e.g. to a whole process
        # group), not an operator insisting.
        now = time.monotonic()
        if self._num_signals == 0 or now - self._first_signal_at >= 1.0:
            self._num_signals += 1
        if self._num_signals == 1:
            self._first_signal_at = now

    def request_drain(self) -> None:
        """What SIGTERM does, for callers that run the loop off the main thread."""
        self._num_signals += 1

    def _check_signals(self) -> None:
        # An operator's drain (no exit) may be under way: SIGTERM still ends in an exit.
        if self._num_signals == 1 and not self._exit_when_drained:
            self._begin_drain(self.config.drain_timeout_s, tell_gateway=True)
        elif self._num_signals >= 2:
            log.warning("second stop signal: exiting now", extra=self._log_extra)
            self._fail_all("worker stopped")
            self.exit_code = EXIT_OK


def _sampling_params(params: dict[str, Any]) -> SamplingParams:
    params = dict(params)
    if params.get("stop_token_ids") is not None:
        params["stop_token_ids"] = tuple(params["stop_token_ids"])
    return SamplingParams(**params)
