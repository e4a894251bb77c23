"""Every message may be lost: fault injection at the ZeroMQ edge (a fake worker that drops
chosen messages) against the real gateway. Each request must end within its bound, and
none twice."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.gateway.helpers import GatewayServer, cyclic_reply, wait_until
from zeroserve.common.protocol import Abort, Credit, Submit, TokenOutput
from zeroserve.gateway.reconcile import TokenCheck, check_token_counts
from zeroserve.gateway.streams import RequestPhase, RequestState


def drop_first(kind, count: int = 1):
    """A drop predicate that loses the first `count` messages of one type."""
    left = [count]

    def drop(msg) -> bool:
        if isinstance(msg, kind) and left[0] > 0:
            left[0] -= 1
            return True
        return False
    return drop


def stream(gw, body: dict, timeout: float = 15.0) -> tuple[str, dict | None, float]:
    """(text, error event or None, seconds) of one streamed completion read to the end."""
    started = time.monotonic()
    text, error = [], None
    with httpx.stream("POST", gw.url + "/v1/completions", timeout=timeout,
                      json={"stream": True, "prompt": "x", **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
            else:
                text.append(event["choices"][0]["text"])
    return "".join(text), error, time.monotonic() - started


def assert_nothing_in_flight(gw, worker) -> None:
    assert wait_until(lambda: len(gw.gateway.streams) == 0, 5), gw.gateway.streams.states
    assert wait_until(lambda: not worker.streams, 5), worker.streams
    assert all(not w.request_ids for w in gw.gateway.registry.workers.values())


@pytest.fixture
def gw():
    with GatewayServer(credit_window=4) as server:
        yield server


def start_worker(gw, **kwargs):
    worker = gw.worker(reply=cyclic_reply("abcd"), step_s=0.005, **kwargs).start()
    assert worker.ready.wait(5)
    return worker


def test_a_lost_submit_is_sent_again(gw):
    worker = start_worker(gw, drop_incoming=drop_first(Submit))
    text, error, _ = stream(gw, {"max_tokens": 20})
    assert error is None and text == "abcd" * 5
    assert worker.num_dropped == 1 and len(worker.submits) == 1  # the second one arrived
    assert_nothing_in_flight(gw, worker)


def test_lost_credit_is_healed_by_the_credit_sent_again(gw):
    worker = start_worker(gw, drop_incoming=drop_first(Credit, 3))
    text, error, _ = stream(gw, {"max_tokens": 40})
    assert error is None and text == "abcd" * 10
    assert worker.num_dropped == 3
    assert_nothing_in_flight(gw, worker)


def test_lost_tokens_mid_stream_show_as_a_gap_and_the_stream_goes_on(gw):
    num_seen = [0]

    def drop_third(msg) -> bool:
        num_seen[0] += 1
        return num_seen[0] == 3
    worker = start_worker(gw, drop_outgoing=drop_third)
    text, error, _ = stream(gw, {"max_tokens": 40})
    # Never a silent hole: the gap is seen, and the stream continues from what arrived.
    assert error is None and text == "abcd" * 10
    assert len(worker.submits) == 2 and len(worker.submits[1].output_token_ids) == 2
    assert_nothing_in_flight(gw, worker)


def test_a_lost_final_message_is_noticed_and_the_stream_completes(gw):
    dropped = []

    def drop_first_finish(msg) -> bool:
        if not dropped and any(o.finish_reason for o in msg.outputs):
            dropped.append(msg)
            return True
        return False
    worker = start_worker(gw, drop_outgoing=drop_first_finish)
    text, error, elapsed = stream(gw, {"max_tokens": 8})
    # Noticed within a heartbeat or so; 10 s for a loaded machine (the stream's own read
    # timeout is 15 s, the idle deadline 300 s).
    assert error is None and text == "abcdabcd" and elapsed < 10
    assert len(worker.submits) == 2 and len(worker.submits[1].output_token_ids) == 7
    assert_nothing_in_flight(gw, worker)


def test_a_stream_whose_messages_keep_getting_lost_ends_with_an_error(gw):
    worker = start_worker(gw, drop_outgoing=lambda msg: any(o.finish_reason
                                                            for o in msg.outputs))
    text, error, _ = stream(gw, {"max_tokens": 8})
    assert text == "abcdabc" and error is not None and error["code"] == "worker_lost"
    assert len(worker.submits) == 4  # bounded: MAX_SUBMITS
    assert_nothing_in_flight(gw, worker)


def test_a_lost_abort_is_sent_again(gw):
    worker = start_worker(gw, drop_incoming=drop_first(Abort))
    worker.step_s = 0.02
    with httpx.stream("POST", gw.url + "/v1/completions", timeout=10,
                      json={"stream": True, "prompt": "x", "max_tokens": 2000}) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))
    # The client left; its ABORT was lost; the worker's heartbeat still lists the request.
    rid = worker.submits[0].request_id
    assert wait_until(lambda: not worker.streams, 5)
    assert worker.aborts == [rid] and worker.num_dropped == 1
    assert_nothing_in_flight(gw, worker)


def test_a_stream_with_credit_and_no_output_fails_at_its_idle_deadline():
    with GatewayServer(request_idle_timeout_s=1.0) as gw:
        worker = start_worker(gw)
        worker.is_stepping = False  # it holds the request (heartbeats list it), emits nothing
        text, error, elapsed = stream(gw, {"max_tokens": 8})
        # Not before the deadline; after it within a check or two (10 s: a loaded machine,
        # still short of the stream's 15 s read timeout).
        assert text == "" and error["code"] == "request_timeout" and 1.0 <= elapsed < 10
        rid = worker.submits[0].request_id
        assert wait_until(lambda: rid in worker.aborts, 3)
        assert_nothing_in_flight(gw, worker)
        worker.stop()


def test_a_worker_the_gateway_does_not_know_is_asked_for_hello(gw):
    worker = start_worker(gw)
    gw.loop.call_soon_threadsafe(gw.gateway.registry.remove, worker.worker_id)
    assert wait_until(lambda: any(h.state == "unknown" for h in worker.gateway_heartbeats), 3)
    hail = next(h for h in worker.gateway_heartbeats if h.state == "unknown")
    assert hail.gateway_id == gw.gateway.gateway_id != ""


def test_a_worker_whose_engine_is_stuck_gets_no_new_work():
    with GatewayServer(worker_stall_timeout_s=5.0) as gw:
        stuck = start_worker(gw, worker_id="stuck")
        stuck.progress_age_s = 60.0  # its I/O thread beats, its engine thread is hung
        healthy = start_worker(gw, worker_id="healthy")
        assert wait_until(lambda: gw.gateway.registry.get("stuck").status.value == "unhealthy")
        status, body = httpx.get(gw.url + "/health").status_code, httpx.get(
            gw.url + "/health").json()
        assert status == 200
        assert {w["worker_id"]: w["status"] for w in body["workers"]} == {
            "stuck": "unhealthy", "healthy": "ready"}
        for _ in range(4):
            text, error, _ = stream(gw, {"max_tokens": 4})
            assert error is None and text == "abcd"
        assert not stuck.submits and len(healthy.submits) == 4
        stuck.progress_age_s = 0.0  # it moves again: it is ready again
        assert wait_until(lambda: gw.gateway.registry.get("stuck").status.value == "ready")
        stuck.stop()
        healthy.stop()


# --- token counts (pure) ------------------------------------------------------------------

def _state(num_received: int) -> RequestState:
    return RequestState("r", 0, [1], asyncio.Queue(), RequestPhase.RUNNING, worker_id="w",
                        num_received=num_received)


def test_token_counts_show_gaps_and_trim_repeats():
    assert check_token_counts(_state(2), TokenOutput("r", [7], None, 1, 3)) is TokenCheck.OK
    assert check_token_counts(_state(2), TokenOutput("r", [7], None, 1, 4)) is TokenCheck.GAP
    assert check_token_counts(_state(3), TokenOutput("r", [7], None, 1, 3)) is \
        TokenCheck.DUPLICATE
    partly_seen = TokenOutput("r", [6, 7], None, 1, 4, logprobs=[[-1.0, []], [-2.0, []]])
    assert check_token_counts(_state(3), partly_seen) is TokenCheck.OK
    assert partly_seen.new_token_ids == [7] and partly_seen.logprobs == [[-2.0, []]]
    # A finish with nothing new (an error after some output) still gets through.
    error = TokenOutput("r", [], "error", 1, 0, error="boom")
    assert check_token_counts(_state(5), error) is TokenCheck.OK


def test_token_counts_drop_what_lies_beyond_the_credit_or_max_tokens():
    # A worker may be 32 tokens (the window) ahead of the credit given back, never more.
    state = _state(30)
    state.num_credited, state.params = 0, {"max_tokens": 100}
    over_credit = TokenOutput("r", [1, 2, 3, 4], None, 1, 34, logprobs=[[-1.0, []]] * 4)
    assert check_token_counts(state, over_credit) is TokenCheck.OVER_LIMIT
    assert over_credit.new_token_ids == [1, 2] and len(over_credit.logprobs) == 2
    state = _state(8)
    state.num_credited, state.params = 16, {"max_tokens": 10}  # max_tokens the tighter one
    over_max = TokenOutput("r", [1, 2, 3], None, 1, 11)
    assert check_token_counts(state, over_max) is TokenCheck.OVER_LIMIT
    assert over_max.new_token_ids == [1, 2]
    # Partly seen and partly beyond: the repeat trimmed first, then the excess.
    state = _state(31)
    state.params = None  # (no params: the credit limit alone)
    both = TokenOutput("r", [5, 6, 7, 8], None, 1, 33)
    assert check_token_counts(state, both) is TokenCheck.OVER_LIMIT
    assert both.new_token_ids == [7]
    within = _state(31)
    within.params = {}
    assert check_token_counts(within, TokenOutput("r", [9], None, 1, 32)) is TokenCheck.OK
