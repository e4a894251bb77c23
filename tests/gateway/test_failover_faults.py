"""Failover under message faults: lose, delay, duplicate and reorder TOKENS and HEARTBEATs,
a worker silent past its timeout that comes back, a restarted worker with the same id, with
one worker and with two under cache-aware routing (a resubmit then usually lands on the
worker it left).

The fake workers handle the gateway's commands steps late (`command_lag_steps`), as a busy
real worker does, so outputs of an attempt the gateway left behind keep arriving after its
ABORT and SUBMIT. Every stream must end with exactly the undisturbed run's tokens (the fake
backend is deterministic), or with a clear error when no worker can take it; no state is
left in the gateway or the workers."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest
import zmq

from tests.gateway.helpers import FakeWorker, GatewayServer, wait_until
from zeroserve.common.protocol import POISON_REQUEST, MsgType, Tokens, encode
from zeroserve.gateway.workers import zmq_io

MAX_TOKENS = 40
NUM_STREAMS = 4


def reply(prompt: list[int], params: dict) -> list[int]:
    """Deterministic and aperiodic enough that a repeated, missing or foreign chunk shows."""
    return [97 + (i * 7 + len(prompt)) % 26 for i in range(params["max_tokens"])]


def expected_text(prompt: str) -> str:
    return bytes(reply(list(prompt.encode()), {"max_tokens": MAX_TOKENS})).decode()


class Faults:
    """A FakeWorker fault hook for one message kind. `actions` maps the number of a message
    (1, 2, ... in sending order) to what happens to it: "lose", "duplicate", "reorder" (it
    goes out after the next one), or an int: held for that many calls (steps), then sent."""

    def __init__(self, actions: dict[int, str | int]):
        self.actions = actions
        self.num_seen = 0
        self.num_faults = 0
        self._held: list[list] = []  # [calls left, message]
        self._reordered: list = []

    def __call__(self, msg) -> list:
        out = []
        for item in self._held:
            item[0] -= 1
        while self._held and self._held[0][0] <= 0:
            out.append(self._held.pop(0)[1])
        if msg is None:
            return out
        self.num_seen += 1
        action = self.actions.get(self.num_seen)
        if action is not None:
            self.num_faults += 1
        if action == "lose":
            return out
        if action == "duplicate":
            return [*out, msg, msg]
        if action == "reorder":
            self._reordered.append(msg)
            return out
        if isinstance(action, int):
            self._held.append([action, msg])
            return out
        out.append(msg)
        out += self._reordered
        self._reordered = []
        return out


def stream_one(url: str, prompt: str, results: dict, timeout: float = 20.0) -> None:
    text, error, finish = [], None, None
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=timeout, json={
                "stream": True, "prompt": prompt, "max_tokens": MAX_TOKENS}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                else:
                    text.append(event["choices"][0]["text"])
                    finish = event["choices"][0]["finish_reason"] or finish
    finally:
        results[prompt] = ("".join(text), error, finish)


def run_streams(gw: GatewayServer, during: Callable[[], None] | None = None,
                num_streams: int = NUM_STREAMS) -> dict:
    """NUM_STREAMS concurrent streams, each with its own prompt; `during` runs meanwhile."""
    results: dict = {}
    threads = [threading.Thread(target=stream_one, args=(gw.url, f"p{i}-{'x' * i}", results))
               for i in range(num_streams)]
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join(30)
    assert len(results) == num_streams
    return results


def assert_exact(results: dict) -> None:
    for prompt, (text, error, finish) in results.items():
        assert error is None, (prompt, error)
        assert text == expected_text(prompt) and finish == "length", (prompt, text, finish)


def assert_no_state_left(gw: GatewayServer, *workers: FakeWorker) -> None:
    gateway = gw.gateway
    assert wait_until(lambda: len(gateway.streams) == 0, 5), gateway.streams.states
    # A resubmit task leaves the set in its done callback, a loop iteration after it ended.
    assert wait_until(lambda: not gateway._resubmit_tasks, 5)
    assert all(not w.request_ids for w in gateway.registry.workers.values())
    for worker in workers:
        assert wait_until(lambda w=worker: not w.streams, 5), worker.streams


def stale_dropped(gw: GatewayServer) -> float:
    return gw.gateway.metrics.stale_outputs._value.get()


def start_workers(gw: GatewayServer, num_workers: int, **kwargs) -> list[FakeWorker]:
    workers = [gw.worker(worker_id=f"w{i}", reply=reply, step_s=0.005, command_lag_steps=2,
                         **kwargs).start() for i in range(num_workers)]
    for w in workers:
        assert w.ready.wait(5)
    return workers


@pytest.fixture(params=["one_worker", "two_workers_cache_aware"])
def setup(request):
    with GatewayServer(credit_window=4, routing="cache_aware") as gw:
        yield gw, 1 if request.param == "one_worker" else 2


def stop_all(workers) -> None:
    for w in workers:
        w.stop()


# --- TOKENS ---------------------------------------------------------------------------------

@pytest.mark.parametrize("actions", [
    {5: "lose"}, {5: "lose", 9: "lose", 30: "lose"}, {5: 6}, {5: "duplicate", 12: "duplicate"},
    {5: "reorder", 20: "reorder"}, {4: "lose", 8: 10, 12: "duplicate", 16: "reorder"},
], ids=["lose", "lose_three", "delay", "duplicate", "reorder", "mixed"])
def test_token_faults_leave_every_stream_exact(setup, actions):
    gw, num_workers = setup
    faults = Faults(actions)
    workers = start_workers(gw, num_workers)
    workers[0].tokens_faults = faults  # the busiest: first pick of every prompt
    assert_exact(run_streams(gw))
    assert faults.num_faults >= 1
    assert_no_state_left(gw, *workers)
    stop_all(workers)


def test_outputs_in_flight_after_a_resubmit_to_the_same_worker_are_dropped_and_counted():
    """A lost TOKENS shows as a gap; the stream is aborted and resubmitted to its only
    worker, which still sends the old attempt's outputs for two steps. They must count for
    nothing: before attempts, each looked like a new gap (more resubmits until the budget was
    spent) or, when contiguous, put the old run's tokens into the stream."""
    with GatewayServer(credit_window=4) as gw:
        (worker,) = start_workers(gw, 1)
        worker.tokens_faults = Faults({3: "lose"})
        assert_exact(run_streams(gw, num_streams=1))
        assert [s.attempt for s in worker.submits] == [1, 2]
        assert stale_dropped(gw) >= 1
        assert_no_state_left(gw, worker)
        worker.stop()


# --- HEARTBEATs -----------------------------------------------------------------------------

@pytest.mark.parametrize("actions", [
    {3: "lose", 4: "lose"}, {3: 10}, {3: "duplicate", 5: "duplicate"}, {3: "reorder"},
], ids=["lose", "delay", "duplicate", "reorder"])
def test_heartbeat_faults_leave_every_stream_exact(setup, actions):
    gw, num_workers = setup
    workers = start_workers(gw, num_workers)
    faults = Faults(actions)
    workers[0].heartbeat_faults = faults
    assert_exact(run_streams(gw))
    assert_no_state_left(gw, *workers)
    stop_all(workers)


def test_a_backlog_of_tokens_behind_heartbeats_is_waited_for_not_resubmitted(monkeypatch):
    """The gateway falls behind its TOKENS socket: each TOKENS message costs it 60 ms of its
    loop (the worker sends one every 5 ms), and it drains at most 4 messages a wake-up
    (_MAX_BATCH, 256 in production: a backlog of more than that behaves alike), so the
    backlog grows past two seconds while heartbeats, on the other socket, overtake it and
    no longer list the streams the worker finished. Nothing is missing until the gateway
    has processed what the heartbeats say was sent. Before, each stream was declared lost
    and submitted again."""
    monkeypatch.setattr(zmq_io, "_MAX_BATCH", 4)
    with GatewayServer(credit_window=64) as gw:
        (worker,) = start_workers(gw, 1)
        handlers = gw.gateway._handlers
        on_tokens = handlers[MsgType.TOKENS]

        def slow_on_tokens(worker_id, msg) -> None:
            time.sleep(0.06)
            on_tokens(worker_id, msg)

        handlers[MsgType.TOKENS] = slow_on_tokens
        results = run_streams(gw)
        assert_exact(results)
        assert len(worker.submits) == NUM_STREAMS  # not one resubmit
        assert_no_state_left(gw, worker)
        worker.stop()


# --- workers that vanish ----------------------------------------------------------------------

def test_a_worker_silent_past_its_timeout_that_comes_back(setup):
    """A GC pause, a short partition, SIGSTOP/SIGCONT: the gateway expires the worker and
    moves its streams; the worker comes back still holding (and emitting) the old attempts."""
    gw, num_workers = setup
    workers = start_workers(gw, num_workers)
    worker = workers[0]
    worker.step_s = 0.02

    def pause_then_resume() -> None:
        assert wait_until(lambda: any(s.num_sent >= 5 for s in list(worker.streams.values())),
                          5)
        worker.is_heartbeating = worker.is_stepping = False
        assert wait_until(lambda: gw.gateway.registry.get("w0") is None, 5)  # expired
        time.sleep(0.2)
        worker.is_heartbeating = worker.is_stepping = True

    assert_exact(run_streams(gw, pause_then_resume))
    assert_no_state_left(gw, *workers)
    stop_all(workers)


def test_a_restarted_worker_with_the_same_id_ignores_the_dead_ones_outputs():
    """The old process's last TOKENS reach the gateway after the new process (same worker
    id) said HELLO and took the streams over: attributed to the id, they are stale."""
    with GatewayServer(credit_window=4) as gw:
        (old,) = start_workers(gw, 1)
        old.step_s = 0.02
        late: list[Tokens] = []
        results: dict = {}

        def restart() -> None:
            assert wait_until(lambda: any(s.num_sent >= 5 for s in list(old.streams.values())),
                              5)
            old.tokens_faults = lambda msg: [] if msg is None else late.append(msg) or []
            assert wait_until(lambda: len(late) >= 3, 5)
            old.stop()  # died with three steps of outputs still queued
            new = gw.worker(worker_id="w0", reply=reply, step_s=0.005, command_lag_steps=2)
            new.start()
            assert new.ready.wait(5)
            assert wait_until(lambda: new.submits, 5)
            ctx = zmq.Context.instance()
            push = ctx.socket(zmq.PUSH)
            push.connect(gw.config.endpoints[1])
            for msg in late:
                push.send_multipart(encode(msg))
            results["new"] = new
            # Closed (linger 0) only once they arrived: after a fixed 0.2 s, a loaded
            # machine's I/O thread may not have sent them yet, and they were discarded.
            assert wait_until(lambda: stale_dropped(gw) >= 1, 10)
            push.close(0)

        streamed = run_streams(gw, restart)
        assert_exact(streamed)
        new = results["new"]
        assert all(s.attempt == 2 for s in new.submits)
        assert stale_dropped(gw) >= 1
        assert_no_state_left(gw, new)
        new.stop()


def test_streams_end_with_a_clear_error_when_no_worker_can_take_them():
    with GatewayServer(credit_window=4, queue_timeout_s=1.0) as gw:
        (worker,) = start_workers(gw, 1)
        worker.step_s = 0.02

        def die() -> None:
            assert wait_until(lambda: any(s.num_sent >= 3 for s in list(worker.streams.values())),
                              5)
            worker.stop()

        results = run_streams(gw, die)
        for _text, error, finish in results.values():
            assert error is not None and error["code"] in ("no_worker", "worker_lost"), error
            assert finish is None
        assert_no_state_left(gw)


def test_a_poison_request_is_failed_not_moved_to_another_worker():
    """A request that made its worker's step fail even when run alone would fail the batch
    of every worker it moved to: the gateway fails it at once (before, it was tried on a
    second worker)."""
    with GatewayServer() as gw:
        workers = start_workers(gw, 2, num_submits_to_refuse=1, refusal_code=POISON_REQUEST)
        r = httpx.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert sum(len(w.submits) for w in workers) == 1
        assert_no_state_left(gw, *workers)
        stop_all(workers)


def test_the_fake_worker_sends_what_is_in_flight_after_an_abort_as_a_real_one_does():
    """The test worker handles the gateway's commands `command_lag_steps` late, as a real
    worker busy in a step: outputs it made before it read an ABORT still go out (and the
    gateway drops them), where before it handled an ABORT before its next step."""
    with GatewayServer(credit_window=64) as gw:
        (worker,) = start_workers(gw, 1)
        full = expected_text("p")
        stop_at = 6
        r = httpx.post(gw.url + "/v1/completions", json={
            "prompt": "p", "max_tokens": MAX_TOKENS, "stop": [full[stop_at]]})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == full[:stop_at]
        assert wait_until(lambda: worker.aborts, 5)
        # One request aborted: once, or again if a heartbeat still listed it before the lagged
        # worker read the first ABORT (reconciliation aborts what the gateway no longer holds).
        rid = worker.aborts[0]
        assert set(worker.aborts) == {rid}
        assert wait_until(lambda: rid not in worker.streams, 5)  # the ABORT handled
        # The gateway saw token stop_at and aborted; the worker made two more steps' tokens.
        assert worker.num_sent[rid] >= stop_at + 1 + worker.command_lag_steps
        assert_no_state_left(gw, worker)
        worker.stop()
