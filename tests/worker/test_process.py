"""The worker process loop against a scripted engine and a hand-driven fake gateway.

The real sockets are used (ipc in a temp dir); only the engine is a stand-in, so these tests
pin the loop's promises: HELLO/READY, credits and pauses, rejections, heartbeats during long
steps, drain, gateway loss.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import pytest
import zmq

from zeroserve.common.protocol import (
    Abort,
    Credit,
    Drain,
    Heartbeat,
    Hello,
    Message,
    Ready,
    Shutdown,
    Submit,
    Tokens,
    Undrain,
    decode,
    encode,
)
from zeroserve.worker.config import WorkerConfig
from zeroserve.worker.model.info import ModelInfo
from zeroserve.worker.outputs import EngineStats, RequestOutput
from zeroserve.worker.outputs import StepTiming as EngineStepTiming
from zeroserve.worker.process import run_worker
from zeroserve.worker.sequence import FinishReason, RequestError, SamplingParams

NUM_BLOCKS = 64
BLOCKS_PER_REQUEST = 2


@dataclass
class _Req:
    prompt: list[int]
    params: SamplingParams
    num_out: int = 0
    is_paused: bool = False


class ScriptedEngine:
    """Engine stand-in: one token per running request per step, finishes at max_tokens."""

    def __init__(self, step_s: float = 0.0):
        self.step_s = step_s
        self.info = ModelInfo("fake-model", "", 128, 1000, (0,), None, 1, 1, 1, "cpu", "float32")
        self.reqs: dict[str, _Req] = {}
        self.aborted: list[RequestOutput] = []
        self.num_steps = 0
        self.num_paused_calls = 0
        self.step_hook = None  # called once inside the next step (e.g. to hang it)
        self.priorities: dict[str, int] = {}  # request id -> its SUBMIT's priority
        self.flows: dict[str, int] = {}  # request id -> its SUBMIT's flow
        self.failures = 0  # the next these many steps raise
        self.held: list[RequestOutput] = []  # the last step's outputs, emitted by the next
        self.last_step = EngineStepTiming()

    def add_request(self, request_id, prompt_token_ids, params, output_token_ids=(),
                    grammar=None, priority=0, flow=0):
        self.priorities[request_id] = priority
        self.flows[request_id] = flow
        if not prompt_token_ids:
            raise RequestError("prompt is empty")
        if request_id in self.reqs:
            raise RequestError("duplicate request id")
        self.reqs[request_id] = _Req(list(prompt_token_ids), params,
                                     num_out=len(output_token_ids))

    def abort(self, request_id):
        req = self.reqs.pop(request_id, None)
        if req is None:
            return False
        self.aborted.append(RequestOutput(request_id, [], FinishReason.ABORT,
                                          len(req.prompt), req.num_out))
        self.held = [out for out in self.held if out.request_id != request_id]
        return True

    def pause(self, request_id):
        self.num_paused_calls += 1
        self.reqs[request_id].is_paused = True
        return True

    def resume(self, request_id):
        self.reqs[request_id].is_paused = False
        return True

    def set_credit_limit(self, request_id, limit):
        pass  # this fake makes one token a step: the process's pause is its only limit

    def has_unfinished(self):
        return bool(self.reqs or self.aborted or self.held)

    def has_admissions(self):
        return False  # no grammars here

    def has_launched_step(self):
        return False  # its steps end within step_overlapped

    def step_overlapped(self, emit):
        """As Engine.step_overlapped: the last step's outputs are emitted after this step's
        batch is chosen, and a request paused by emit loses this step's token."""
        self.num_steps += 1
        batch = [rid for rid, req in self.reqs.items() if not req.is_paused]
        self.last_step = EngineStepTiming(num_seqs=len(batch))
        emit(self.take_outputs())
        time.sleep(self.step_s)
        if self.step_hook is not None:
            hook, self.step_hook = self.step_hook, None
            hook()
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("injected step failure")
        outputs = self.held = []
        for rid in batch:
            req = self.reqs.get(rid)
            if req is None or req.is_paused:
                continue
            req.num_out += 1
            done = req.num_out >= req.params.max_tokens
            outputs.append(RequestOutput(rid, [100 + req.num_out],
                                         FinishReason.LENGTH if done else None,
                                         len(req.prompt), req.num_out))
            if done:
                del self.reqs[rid]

    def take_outputs(self):
        outputs = self.aborted + self.held
        self.aborted, self.held = [], []
        return outputs

    def stats(self):
        num_paused = sum(r.is_paused for r in self.reqs.values())
        return EngineStats(
            num_running=len(self.reqs) - num_paused, num_waiting=0, num_paused=num_paused,
            num_free_blocks=NUM_BLOCKS - BLOCKS_PER_REQUEST * len(self.reqs),
            num_cached_blocks=0, num_total_blocks=NUM_BLOCKS, num_preemptions=0,
            num_steps=self.num_steps,
        )


class FakeGateway:
    """Binds what a gateway binds and lets a test speak for it."""

    def __init__(self, tmp_path, worker_id: str):
        self.ctx = zmq.Context()
        self.worker_id = worker_id
        self.route: bytes | None = None  # the worker's DEALER routing id, once it spoke
        self.router_address = f"ipc://{tmp_path}/router"
        self.tokens_address = f"ipc://{tmp_path}/tokens"
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(self.router_address)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.tokens_address)
        self.heartbeats: list[Heartbeat] = []

    def recv(self, kind: type[Message], timeout_s: float = 5.0) -> Message:
        """The next message of `kind` from the worker's DEALER (heartbeats are recorded)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.router.poll(int((deadline - time.monotonic()) * 1000) + 1):
                route, *frames = self.router.recv_multipart()
                # The worker's id plus a per-process secret suffix.
                assert route.decode().startswith(self.worker_id + ".")
                self.route = route
                msg = decode(frames)
                if isinstance(msg, Heartbeat):
                    self.heartbeats.append(msg)
                if isinstance(msg, kind):
                    return msg
        raise TimeoutError(f"no {kind.__name__} within {timeout_s}s")

    def beat_after(self, wall_time: float, timeout_s: float = 5.0) -> Heartbeat:
        """The first heartbeat sent after `wall_time` (older ones queue up unread)."""
        deadline = time.monotonic() + timeout_s
        while True:
            beat = self.recv(Heartbeat, timeout_s=max(0.01, deadline - time.monotonic()))
            if beat.time > wall_time:
                return beat

    def beat_where(self, predicate, timeout_s: float = 10.0) -> Heartbeat:
        """The first heartbeat for which `predicate` holds (a command sent just now may be
        handled after the next few beats on a loaded machine)."""
        deadline = time.monotonic() + timeout_s
        while True:
            beat = self.recv(Heartbeat, timeout_s=max(0.01, deadline - time.monotonic()))
            if predicate(beat):
                return beat
            if time.monotonic() > deadline:
                raise AssertionError(f"no heartbeat within {timeout_s}s like that; last: {beat}")

    def send(self, msg: Message) -> None:
        assert self.route is not None, "the worker has not spoken yet"
        self.router.send_multipart([self.route, *encode(msg)])

    def tokens(self, timeout_s: float = 5.0) -> Tokens | None:
        if not self.pull.poll(int(timeout_s * 1000)):
            return None
        return decode(self.pull.recv_multipart())

    def collect(self, until_finished: set[str], timeout_s: float = 5.0) -> dict[str, list]:
        """Token outputs per request until all of `until_finished` have a finish reason."""
        per_request: dict[str, list] = {}
        deadline = time.monotonic() + timeout_s
        pending = set(until_finished)
        while pending and time.monotonic() < deadline:
            msg = self.tokens(deadline - time.monotonic())
            if msg is None:
                break
            for out in msg.outputs:
                per_request.setdefault(out.request_id, []).append(out)
                if out.finish_reason is not None:
                    pending.discard(out.request_id)
        assert not pending, f"unfinished: {pending}"
        return per_request

    def collect_n(self, request_id: str, num_tokens: int, timeout_s: float = 5.0) -> list:
        """Token outputs of one request until it has sent num_tokens tokens."""
        outs, num = [], 0
        deadline = time.monotonic() + timeout_s
        while num < num_tokens and time.monotonic() < deadline:
            msg = self.tokens(deadline - time.monotonic())
            for out in msg.outputs if msg is not None else []:
                if out.request_id == request_id:
                    outs.append(out)
                    num += len(out.new_token_ids)
        assert num >= num_tokens, f"{request_id}: {num} of {num_tokens} tokens"
        return outs

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class RunningWorker:
    def __init__(self, config: WorkerConfig, engine: ScriptedEngine):
        self.exit_code: int | None = None
        self.thread = threading.Thread(target=self._run, args=(config, engine), daemon=True)
        self.thread.start()

    def _run(self, config, engine):
        self.exit_code = run_worker(config, engine=engine)

    def wait(self, timeout_s: float = 5.0) -> int | None:
        self.thread.join(timeout_s)
        return self.exit_code


WORKER_ID = "worker-test"


@pytest.fixture
def gateway(tmp_path):
    gw = FakeGateway(tmp_path, WORKER_ID)
    yield gw
    gw.close()


def start(gateway: FakeGateway, engine: ScriptedEngine | None = None, gateway_id: str = "",
          **overrides):
    engine = engine or ScriptedEngine()
    config = WorkerConfig(
        worker_id=WORKER_ID, router_address=gateway.router_address,
        tokens_address=gateway.tokens_address,
        heartbeat_interval_s=overrides.pop("heartbeat_interval_s", 0.05),
        gateway_timeout_s=overrides.pop("gateway_timeout_s", 5.0), **overrides,
    )
    worker = RunningWorker(config, engine)
    hello = gateway.recv(Hello)
    gateway.send(Ready(True, "", 0.05, gateway_id))
    return worker, engine, hello


def stop(gateway: FakeGateway, worker: RunningWorker) -> None:
    gateway.send(Shutdown("test over"))
    assert worker.wait() == 0


def test_hello_describes_the_worker(gateway):
    worker, engine, hello = start(gateway)
    assert hello.worker_id == WORKER_ID and hello.model == "fake-model"
    assert hello.max_model_len == 128 and hello.num_kv_blocks == NUM_BLOCKS
    assert hello.device == "cpu" and hello.pid > 0
    stop(gateway, worker)


def test_submit_streams_every_token_then_finishes(gateway):
    worker, engine, _ = start(gateway)
    gateway.send(Submit("a", [1, 2, 3], {"max_tokens": 5}, 32))
    gateway.send(Submit("b", [4], {"max_tokens": 3, "stop_token_ids": [9]}, 32))
    outs = gateway.collect({"a", "b"})
    assert [t for o in outs["a"] for t in o.new_token_ids] == [101, 102, 103, 104, 105]
    assert outs["a"][-1].finish_reason == "length" and outs["a"][-1].num_output_tokens == 5
    assert len([t for o in outs["b"] for t in o.new_token_ids]) == 3
    stop(gateway, worker)


def test_a_submits_priority_and_flow_reach_the_engine(gateway):
    worker, engine, _ = start(gateway)
    gateway.send(Submit("low", [1], {"max_tokens": 2}, 32, priority=1, flow=77))
    gateway.send(Submit("plain", [1], {"max_tokens": 2}, 32))
    gateway.collect({"low", "plain"})
    assert engine.priorities == {"low": 1, "plain": 0}
    assert engine.flows == {"low": 77, "plain": 0}
    stop(gateway, worker)


def test_one_tokens_message_carries_all_streams_of_a_step(gateway):
    engine = ScriptedEngine(step_s=0.05)  # slow steps, so both submits land before step 1
    worker, _, _ = start(gateway, engine)
    gateway.send(Submit("a", [1], {"max_tokens": 4}, 32))
    gateway.send(Submit("b", [1], {"max_tokens": 4}, 32))
    seen_together = False
    for _ in range(8):
        msg = gateway.tokens()
        ids = {o.request_id for o in msg.outputs}
        seen_together |= ids == {"a", "b"}
        if any(o.finish_reason for o in msg.outputs if o.request_id == "b"):
            break
    assert seen_together
    stop(gateway, worker)


def test_stream_pauses_at_the_window_and_resumes_on_credit(gateway):
    worker, engine, _ = start(gateway)
    gateway.send(Submit("slow", [1], {"max_tokens": 10}, 3))
    got = []
    while len(got) < 3:
        got += gateway.tokens().outputs[0].new_token_ids
    # The window is spent: nothing more may arrive, and the engine holds it paused.
    assert gateway.tokens(timeout_s=0.3) is None
    assert engine.reqs["slow"].is_paused
    beat = gateway.beat_after(time.time())
    assert beat.num_paused == 1 and beat.num_running == 0
    gateway.send(Credit([["slow", 5]]))  # limits are cumulative: up to token 5 in all
    while len(got) < 5:
        got += gateway.tokens().outputs[0].new_token_ids
    assert gateway.tokens(timeout_s=0.3) is None
    gateway.send(Credit([["slow", 4]]))  # an old (reordered or repeated) limit grants nothing
    assert gateway.tokens(timeout_s=0.3) is None
    gateway.send(Credit([["slow", 100]]))
    outs = gateway.collect({"slow"})
    got += [t for o in outs["slow"] for t in o.new_token_ids]
    assert got == list(range(101, 111))
    stop(gateway, worker)


def test_a_paused_stream_does_not_slow_the_others(gateway):
    worker, engine, _ = start(gateway)
    gateway.send(Submit("stuck", [1], {"max_tokens": 50}, 2))
    gateway.send(Submit("fast", [1], {"max_tokens": 20}, 32))
    outs = gateway.collect({"fast"})
    assert sum(len(o.new_token_ids) for o in outs["fast"]) == 20
    assert sum(len(o.new_token_ids) for o in outs["stuck"]) == 2
    stop(gateway, worker)


@pytest.mark.parametrize("params,prompt,fragment", [
    ({"max_tokens": 0}, [1], "max_tokens"),
    ({"temperature": -1.0}, [1], "temperature"),
    ({"no_such_param": 1}, [1], "no_such_param"),
    ({"max_tokens": "many"}, [1], ""),
    ({}, [], "empty"),
])
def test_bad_requests_become_error_outputs(gateway, params, prompt, fragment):
    worker, engine, _ = start(gateway)
    gateway.send(Submit("bad", prompt, params, 8))
    out = gateway.collect({"bad"})["bad"][-1]
    assert out.finish_reason == "error" and fragment in out.error and out.new_token_ids == []
    # The worker keeps serving after a rejection.
    gateway.send(Submit("good", [1], {"max_tokens": 2}, 8))
    assert gateway.collect({"good"})["good"][-1].finish_reason == "length"
    stop(gateway, worker)


def test_abort_frees_the_request_at_once(gateway):
    worker, engine, _ = start(gateway)
    gateway.send(Submit("a", [1], {"max_tokens": 1000}, 5))
    gateway.tokens()
    # A heartbeat sent before the SUBMIT was handled (still queued here) also shows nothing
    # held: first read past those, to one that holds "a".
    gateway.beat_where(lambda b: b.num_running + b.num_paused == 1)
    gateway.send(Abort(["a", "never-heard-of"]))
    # Handled on arrival: the next heartbeats say so (polled, not after a fixed nap).
    gateway.beat_where(lambda b: b.num_running == 0 and b.num_paused == 0
                       and b.num_free_blocks == NUM_BLOCKS)
    assert "a" not in engine.reqs
    stop(gateway, worker)


def test_heartbeats_keep_pace_during_a_long_step(gateway):
    # A long step, so that the window below lies inside it even on a loaded machine (a 0.6 s
    # step with the window ending at 0.55 s saw the next step begin).
    engine = ScriptedEngine(step_s=2.0)
    worker, _, _ = start(gateway, engine)
    gateway.send(Submit("a", [1], {"max_tokens": 1}, 4))
    # Until the step has begun (after a fixed 0.1 s nap, a worker that took the SUBMIT
    # 0.55 s late on a loaded machine had not stepped by the window's end).
    deadline = time.monotonic() + 10
    while engine.num_steps == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    window = (time.time(), time.time() + 0.45)  # inside the 2 s step
    gateway.heartbeats.clear()
    gateway.beat_after(window[1])
    during = [b for b in gateway.heartbeats if window[0] < b.time < window[1]]
    assert engine.num_steps == 1
    assert len(during) >= 4  # every 50 ms, while the engine thread was busy in its step
    stop(gateway, worker)


def _thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _cpu_s(thread_ids: set[int]) -> float:
    """CPU seconds (user + system) the given threads of this process have used; threads
    that have ended count as nothing."""
    ticks = 0
    for tid in thread_ids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc (Linux)")
def test_idle_worker_does_not_spin(gateway):
    # The worker's own threads (its loop and its sockets' I/O threads) are measured, not the
    # whole test process, where what earlier tests left running would count too.
    before = _thread_ids()
    worker, engine, _ = start(gateway)
    time.sleep(0.2)
    threads = _thread_ids() - before
    assert threads
    cpu_before, wall_before = _cpu_s(threads), time.monotonic()
    time.sleep(1.0)
    cpu = _cpu_s(threads) - cpu_before
    assert cpu < 0.15 * (time.monotonic() - wall_before)
    assert engine.num_steps == 0
    stop(gateway, worker)


def test_drain_finishes_in_flight_refuses_new_and_exits_zero(gateway):
    engine = ScriptedEngine(step_s=0.01)
    worker, _, _ = start(gateway, engine)
    gateway.send(Submit("old", [1], {"max_tokens": 20}, 32))
    gateway.tokens()
    gateway.send(Drain("gateway", 10.0))
    gateway.send(Submit("new", [1], {"max_tokens": 5}, 32))
    outs = gateway.collect({"old", "new"})
    assert outs["new"][-1].finish_reason == "abort" and "draining" in outs["new"][-1].error
    assert outs["old"][-1].finish_reason == "length"
    assert worker.wait() == 0


def test_drain_deadline_hands_the_stragglers_back(gateway):
    worker, engine, _ = start(gateway)
    gateway.send(Submit("stuck", [1], {"max_tokens": 100}, 1))  # pauses after one token
    gateway.tokens()
    gateway.send(Drain("gateway", 0.3))
    outs = gateway.collect({"stuck"})
    # "abort": not the request's fault; the gateway moves it to another worker.
    assert outs["stuck"][-1].finish_reason == "abort"
    assert "drain deadline" in outs["stuck"][-1].error
    assert worker.wait() == 0
    assert not engine.reqs  # its blocks were freed


def test_a_drain_without_exit_keeps_the_worker_until_undrained(gateway):
    worker, engine, _ = start(gateway)
    gateway.send(Drain("gateway", 5.0, exit_when_drained=False))
    gateway.send(Submit("refused", [1], {"max_tokens": 2}, 8))
    assert gateway.collect({"refused"})["refused"][-1].finish_reason == "abort"
    assert gateway.beat_after(time.time()).state == "draining"
    assert worker.wait(0.5) is None  # still running, idle
    gateway.send(Undrain("gateway"))
    gateway.send(Submit("taken", [1], {"max_tokens": 2}, 8))
    assert gateway.collect({"taken"})["taken"][-1].finish_reason == "length"
    assert gateway.beat_after(time.time()).state == "ready"
    stop(gateway, worker)


def test_a_drain_and_an_undrain_are_told_in_a_heartbeat_at_once(gateway):
    """With several gateways, the one that asked for a drain shows it until a heartbeat says
    "draining": the worker says it at once, not at its next beat, so an undrain through
    another gateway cannot come first and leave the drain showing for good."""
    # Periodic beats a minute apart: any beat within the generous waits below is an at-once one.
    worker, engine, _ = start(gateway, heartbeat_interval_s=60.0, gateway_timeout_s=120.0)
    gateway.send(Drain("gateway", 5.0, exit_when_drained=False))
    assert gateway.recv(Heartbeat, timeout_s=20.0).state == "draining"
    gateway.send(Undrain("gateway"))
    assert gateway.recv(Heartbeat, timeout_s=20.0).state == "ready"
    stop(gateway, worker)


def test_request_drain_tells_the_gateway(gateway, tmp_path):
    from zeroserve.worker.process import WorkerLoop

    config = WorkerConfig(WORKER_ID, gateway.router_address, gateway.tokens_address,
                          heartbeat_interval_s=0.05, drain_timeout_s=5.0)
    loop = WorkerLoop(config, ScriptedEngine())
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    gateway.recv(Hello)
    gateway.send(Ready(True))
    loop.request_drain()  # what the SIGTERM handler does
    drain = gateway.recv(Drain)
    assert drain.worker_id == WORKER_ID and drain.deadline_s == 5.0
    thread.join(5)
    assert loop.exit_code == 0


def test_sigterm_during_an_operator_drain_still_exits(gateway):
    """An operator's drain (no exit) must not swallow SIGTERM: the worker finishes what it
    holds and exits 0 instead of running until SIGKILL."""
    from zeroserve.worker.process import WorkerLoop

    config = WorkerConfig(WORKER_ID, gateway.router_address, gateway.tokens_address,
                          heartbeat_interval_s=0.05, drain_timeout_s=5.0)
    loop = WorkerLoop(config, ScriptedEngine(step_s=0.01))
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    gateway.recv(Hello)
    gateway.send(Ready(True))
    gateway.send(Submit("old", [1], {"max_tokens": 20}, 32))
    gateway.tokens()
    gateway.send(Drain("gateway", 30.0, exit_when_drained=False))
    # Polled: a periodic beat sent before the worker handled the DRAIN still says "ready"
    # (the first beat after the send said so in 2 runs of 100 while "old" was stepping).
    gateway.beat_where(lambda b: b.state == "draining")
    loop.request_drain()  # what the SIGTERM handler does
    assert gateway.collect({"old"})["old"][-1].finish_reason == "length"
    thread.join(5)
    assert not thread.is_alive() and loop.exit_code == 0


def test_silent_gateway_is_a_pause_and_the_stream_continues(gateway):
    worker, engine, _ = start(gateway, gateway_timeout_s=0.3, gateway_grace_s=10.0)
    gateway.send(Submit("a", [1], {"max_tokens": 6}, 2))
    got = [t for o in gateway.collect_n("a", 2) for t in o.new_token_ids]
    # The fake gateway never heartbeats: the worker says HELLO again but keeps the stream,
    # paused at its credit, for the grace period.
    assert gateway.recv(Hello, timeout_s=3).worker_id == WORKER_ID
    time.sleep(0.5)
    assert engine.reqs["a"].is_paused
    gateway.send(Ready(True))  # the same gateway (same id) is back
    gateway.send(Credit([["a", 6]]))
    outs = gateway.collect({"a"})
    got += [t for o in outs["a"] for t in o.new_token_ids]
    assert outs["a"][-1].finish_reason == "length" and got == list(range(101, 107))
    stop(gateway, worker)


def test_silence_past_the_grace_period_fails_the_streams(gateway):
    worker, engine, _ = start(gateway, gateway_timeout_s=0.2, gateway_grace_s=0.6)
    gateway.send(Submit("a", [1], {"max_tokens": 1000}, 2))
    outs = gateway.collect({"a"})
    assert outs["a"][-1].finish_reason == "abort" and "gateway" in outs["a"][-1].error
    assert not engine.reqs  # its KV is free
    gateway.send(Ready(True))
    gateway.send(Submit("b", [1], {"max_tokens": 2}, 8))
    assert gateway.collect({"b"})["b"][-1].finish_reason == "length"
    stop(gateway, worker)


def test_a_restarted_gateway_makes_the_worker_drop_old_streams_at_once(gateway):
    worker, engine, _ = start(gateway, gateway_id="gw-old")
    gateway.send(Submit("a", [1], {"max_tokens": 1000}, 2))
    gateway.collect_n("a", 2)
    # A new gateway process on the same address: its first heartbeat names another id.
    gateway.send(Heartbeat(WORKER_ID, "unknown", gateway_id="gw-new"))
    assert gateway.recv(Hello, timeout_s=2).worker_id == WORKER_ID
    outs = gateway.collect({"a"}, timeout_s=2)
    assert outs["a"][-1].finish_reason == "abort" and "restarted" in outs["a"][-1].error
    assert not engine.reqs
    gateway.send(Ready(True, "", 0.05, "gw-new"))
    gateway.send(Submit("b", [1], {"max_tokens": 2}, 8))
    assert gateway.collect({"b"})["b"][-1].finish_reason == "length"
    stop(gateway, worker)


def test_a_gateway_that_forgot_the_worker_gets_a_hello_and_streams_stay(gateway):
    worker, engine, _ = start(gateway, gateway_id="gw-1")
    gateway.send(Submit("a", [1], {"max_tokens": 1000}, 2))
    gateway.collect_n("a", 2)
    gateway.send(Heartbeat(WORKER_ID, "unknown", gateway_id="gw-1"))
    gateway.recv(Hello, timeout_s=2)
    assert "a" in engine.reqs
    stop(gateway, worker)


def test_heartbeats_list_the_requests_held_and_engine_progress(gateway):
    worker, engine, _ = start(gateway)
    gateway.send(Submit("a", [1], {"max_tokens": 1000}, 2))
    gateway.send(Submit("b", [1], {"max_tokens": 1000}, 2))
    gateway.collect_n("b", 2)
    beat = gateway.beat_after(time.time())
    assert sorted(beat.request_ids) == ["a", "b"] and beat.num_steps >= 2
    # Fresh (generous for a loaded machine; a hung engine's age grows without bound).
    assert beat.progress_age_s < 5.0 and beat.request_ids_age_s < 5.0
    gateway.send(Abort(["a"]))
    gateway.beat_where(lambda b: b.request_ids == ["b"])
    stop(gateway, worker)


def test_a_hung_engine_shows_in_heartbeats(gateway):
    entered, release = threading.Event(), threading.Event()
    engine = ScriptedEngine()
    worker, _, _ = start(gateway, engine)
    # The next step hangs until released.
    engine.step_hook = lambda: (entered.set(), release.wait())
    gateway.send(Submit("a", [1], {"max_tokens": 3}, 8))
    assert entered.wait(5)
    time.sleep(1.0)
    beat = gateway.beat_after(time.time())  # the link thread still beats
    # The id snapshot predates the SUBMIT and says so: the gateway will not call "a" lost.
    assert beat.progress_age_s > 0.8 and beat.request_ids_age_s > 0.8
    release.set()
    assert gateway.collect({"a"})["a"][-1].finish_reason == "length"
    # Progress again: the age starts over (below what the hang had reached).
    assert gateway.beat_after(time.time()).progress_age_s < beat.progress_age_s
    stop(gateway, worker)


def test_one_failed_step_fails_its_streams_and_the_worker_goes_on(gateway):
    engine = ScriptedEngine()
    worker, _, _ = start(gateway, engine)
    engine.failures = 1
    gateway.send(Submit("a", [1], {"max_tokens": 3}, 8))
    assert gateway.collect({"a"})["a"][-1].finish_reason == "abort"
    gateway.send(Submit("b", [1], {"max_tokens": 3}, 8))
    assert gateway.collect({"b"})["b"][-1].finish_reason == "length"
    stop(gateway, worker)


def test_steps_failing_in_a_row_make_the_worker_exit_nonzero(gateway):
    engine = ScriptedEngine()
    worker, _, _ = start(gateway, engine, max_step_failures=3)
    engine.failures = 100
    for rid in ("a", "b", "c"):
        gateway.send(Submit(rid, [1], {"max_tokens": 3}, 8))
        assert gateway.collect({rid})[rid][-1].finish_reason == "abort"
    assert worker.wait() == 1


def test_refused_worker_exits_nonzero(tmp_path):
    gateway = FakeGateway(tmp_path, WORKER_ID)
    try:
        config = WorkerConfig(WORKER_ID, gateway.router_address, gateway.tokens_address)
        worker = RunningWorker(config, ScriptedEngine())
        gateway.recv(Hello)
        gateway.send(Ready(False, "wrong model"))
        assert worker.wait() == 3
    finally:
        gateway.close()


def test_bad_frames_from_the_gateway_are_dropped(gateway):
    worker, engine, _ = start(gateway)
    gateway.router.send_multipart([gateway.route, b"\xff", b"junk"])
    gateway.router.send_multipart([gateway.route, b"\x03"])
    gateway.send(Tokens("not-for-workers", 1, []))  # well-formed, but not a G->W message
    gateway.send(Submit("a", [1], {"max_tokens": 2}, 8))
    assert gateway.collect({"a"})["a"][-1].finish_reason == "length"
    stop(gateway, worker)


def test_config_validation():
    with pytest.raises(ValueError):
        WorkerConfig("w", "ipc://a", "ipc://b", backend="gpu-magic")
    with pytest.raises(ValueError):
        WorkerConfig("", "ipc://a", "ipc://b")
    with pytest.raises(ValueError):
        WorkerConfig("w", "ipc://a", "ipc://b", heartbeat_interval_s=2, gateway_timeout_s=1)


@pytest.mark.slow  # waits out several gateway timeouts
def test_a_late_gateway_gets_exactly_one_hello(tmp_path):
    router, tokens = f"ipc://{tmp_path}/router", f"ipc://{tmp_path}/tokens"
    # A 1 s timeout: the live gateway below heartbeats every ~0.1 s, and a loaded machine may
    # hold this thread back longer than the 0.3 s it was (the worker then rightly says HELLO).
    config = WorkerConfig(WORKER_ID, router, tokens, heartbeat_interval_s=0.05,
                          gateway_timeout_s=1.0)
    worker = RunningWorker(config, ScriptedEngine())
    time.sleep(3.5)  # several gateway timeouts pass with nobody listening
    gateway = FakeGateway(tmp_path, WORKER_ID)
    try:
        gateway.recv(Hello)
        gateway.send(Ready(True))
        num_hellos = 0
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            gateway.send(Heartbeat("gateway"))  # a live gateway keeps the worker's trust
            try:
                gateway.recv(Hello, timeout_s=0.1)
                num_hellos += 1
            except TimeoutError:
                pass
        assert num_hellos == 0
        stop(gateway, worker)
    finally:
        gateway.close()


def test_a_stream_moved_here_goes_on_after_its_tokens(gateway):
    worker, engine, _ = start(gateway)
    # Failover: it produced 101, 102 on another worker; its credit limit counts them.
    gateway.send(Submit("moved", [1], {"max_tokens": 5}, 4, [101, 102]))
    outs = gateway.collect_n("moved", 2)
    assert gateway.tokens(timeout_s=0.3) is None
    assert [t for o in outs for t in o.new_token_ids] == [103, 104]
    assert [o.num_output_tokens for o in outs] == [3, 4]
    # The window (limit 4 in all) is spent: paused until credit raises it.
    assert engine.reqs["moved"].is_paused
    gateway.send(Credit([["moved", 8]]))
    outs = gateway.collect({"moved"})["moved"]
    assert outs[-1].new_token_ids == [105] and outs[-1].finish_reason == "length"
    stop(gateway, worker)
