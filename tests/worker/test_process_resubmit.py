"""A SUBMIT of a request the worker already holds: the gateway lost track of this worker for
a while (a cut link) and sends its streams again. The stream must go on from where the
gateway's copy is, never stay paused or be ignored (issue 13: workers across hosts)."""

from __future__ import annotations

import threading
import time

from tests.worker.factories import make_engine
from tests.worker.test_process import ScriptedEngine, start, stop
from tests.worker.test_process import gateway as gateway  # noqa: F401 (fixture)
from zeroserve.common.protocol import Abort, Credit, Submit
from zeroserve.worker.sequence import SamplingParams


class Engine(ScriptedEngine):
    def add_request(self, request_id, prompt_token_ids, params, output_token_ids=(), **_):
        super().add_request(request_id, prompt_token_ids, params, output_token_ids)


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_a_repeated_submit_where_the_gateway_is_continues_the_paused_stream(gateway):  # noqa: F811
    worker, engine, _ = start(gateway, Engine())
    gateway.send(Submit("s", [1], {"max_tokens": 8}, 3))
    assert tokens_of(gateway.collect_n("s", 3)) == [101, 102, 103]
    assert gateway.tokens(timeout_s=0.3) is None  # paused at its window
    # The gateway's copy holds the same 3 tokens; its new SUBMIT carries a higher limit.
    gateway.send(Submit("s", [1], {"max_tokens": 8}, 6, [101, 102, 103]))
    outs = gateway.collect_n("s", 3)
    assert tokens_of(outs) == [104, 105, 106] and outs[0].num_output_tokens == 4
    stop(gateway, worker)


def test_a_repeated_submit_behind_the_worker_restarts_from_the_gateways_tokens(gateway):  # noqa: F811
    worker, engine, _ = start(gateway, Engine())
    gateway.send(Submit("s", [1], {"max_tokens": 8}, 4))
    assert tokens_of(gateway.collect_n("s", 4)) == [101, 102, 103, 104]
    # Tokens 103 and 104 never reached the gateway (the link was down): it resubmits with
    # the two it has. The worker starts over from there, and no stale ABORT ends it.
    gateway.send(Submit("s", [1], {"max_tokens": 8}, 10, [101, 102]))
    outs = gateway.collect({"s"})["s"]
    assert all(o.finish_reason in (None, "length") for o in outs), outs
    assert tokens_of(outs) == [103, 104, 105, 106, 107, 108]
    assert outs[0].num_output_tokens == 3 and outs[-1].finish_reason == "length"
    stop(gateway, worker)


def test_abort_then_submit_of_the_same_id_runs_the_new_one(gateway):  # noqa: F811
    """The gateway found a gap in a stream: it aborts it here and submits it again at once
    (both before the next step). The old one's ABORT output must not end the new one."""
    worker, engine, _ = start(gateway, Engine())
    gateway.send(Submit("s", [1], {"max_tokens": 6}, 2))
    assert tokens_of(gateway.collect_n("s", 2)) == [101, 102]
    gateway.send(Abort(["s"]))
    gateway.send(Submit("s", [1], {"max_tokens": 6}, 10, [101]))
    outs = gateway.collect({"s"})["s"]
    assert tokens_of(outs) == [102, 103, 104, 105, 106]
    assert outs[-1].finish_reason == "length"
    stop(gateway, worker)


def test_abort_then_submit_of_a_request_that_just_finished_runs_the_new_one(gateway):  # noqa: F811
    """The real engine holds a step's outputs until the next step's device time. A request
    that finished in the last step and is aborted and submitted again before its finish went
    out (the gateway found a gap): that held finish belongs to the old one; it must not end
    the new one, whose own tokens must come."""
    engine = make_engine()
    params = {"max_tokens": 3, "temperature": 0.0}
    reference = make_engine().generate([[5, 6, 7, 8]], SamplingParams(**params))[0]
    entered, release = threading.Event(), threading.Event()
    real_step = engine.step_overlapped

    def step_overlapped(emit):
        real_step(emit)
        if engine.scheduler.get("s") is None and not entered.is_set():
            entered.set()  # "s" finished in this step; its finish is held
            release.wait(5)

    engine.step_overlapped = step_overlapped
    worker, _, _ = start(gateway, engine)
    gateway.send(Submit("s", [5, 6, 7, 8], params, 10))
    assert entered.wait(5)
    assert tokens_of(gateway.collect_n("s", 2)) == reference[:2]
    # The gateway lost the second token: it aborts "s" and submits it again from the first.
    gateway.send(Abort(["s"]))
    gateway.send(Submit("s", [5, 6, 7, 8], params, 10, reference[:1]))
    time.sleep(0.3)  # both reach the worker before its next step
    release.set()
    outs = gateway.collect({"s"})["s"]
    assert tokens_of(outs) == reference[1:]
    assert outs[0].num_output_tokens == 2 and outs[-1].finish_reason == "length"
    stop(gateway, worker)


def test_a_failover_with_its_window_full_waits_for_credit_before_its_first_token(gateway):  # noqa: F811
    """The client read nothing of its last window: the gateway holds a window of tokens,
    and the new worker's limit equals the tokens it is given. Its first step must not run
    (that token would go out past the limit, be dropped, and the next look like a gap; when
    it was the last one, the stream ended `length` one token short)."""
    worker, engine, _ = start(gateway, Engine())
    gateway.send(Submit("s", [1], {"max_tokens": 4}, 3, [101, 102, 103], None, 2))
    assert gateway.tokens(timeout_s=0.3) is None  # nothing past the limit of 3
    gateway.send(Credit([["s", 5, 2]]))  # the client read its window
    outs = gateway.collect({"s"})["s"]
    assert tokens_of(outs) == [104] and outs[-1].finish_reason == "length"
    assert outs[-1].num_output_tokens == 4 and outs[-1].attempt == 2
    stop(gateway, worker)


def test_a_late_abort_or_credit_of_an_earlier_attempt_leaves_the_current_one_alone(gateway):  # noqa: F811
    worker, engine, _ = start(gateway, Engine())
    gateway.send(Submit("s", [1], {"max_tokens": 8}, 2))
    assert tokens_of(gateway.collect_n("s", 2)) == [101, 102]
    # The gateway found attempt 1 lost and moved it here again as attempt 2; attempt 1's
    # ABORT and a CREDIT of it arrive late.
    gateway.send(Submit("s", [1], {"max_tokens": 8}, 4, [101, 102], None, 2))
    gateway.send(Abort(["s"], [1]))
    gateway.send(Credit([["s", 8, 1]]))
    outs = gateway.collect_n("s", 2)
    assert tokens_of(outs) == [103, 104] and {o.attempt for o in outs} == {2}
    assert gateway.tokens(timeout_s=0.3) is None  # attempt 1's credit granted nothing
    # Heartbeats name the attempt held and the last TOKENS sent (reconciliation's inputs).
    beat = gateway.beat_after(time.time())
    assert beat.request_ids == ["s"] and beat.request_attempts == [2]
    assert beat.tokens_seq == outs[-1].num_output_tokens  # one TOKENS per token here
    gateway.send(Abort(["s"], [2]))
    deadline = time.monotonic() + 5
    while engine.reqs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.reqs  # the current attempt's ABORT ends it
    stop(gateway, worker)
