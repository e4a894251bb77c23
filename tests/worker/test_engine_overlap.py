"""Engine.step_overlapped (async output processing, as the worker's loop runs the engine):
a step's outputs are emitted while the next step's device time runs, and nothing a stream
sees may differ from the plain step(): the same tokens, each once, never past its credit."""

from __future__ import annotations

import pytest

from tests.worker.factories import make_config, make_engine, make_params, prompt
from zeroserve.worker.engine import Engine
from zeroserve.worker.fake_runner import FakeRunner
from zeroserve.worker.sequence import FinishReason

pytestmark = pytest.mark.timeout(60)


def run_overlapped(engine, on_emit=None, max_steps=200):
    """Step until done; returns {request id: tokens} and the finish reasons, by request."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}

    def emit(outputs):
        for out in outputs:
            assert out.request_id not in reasons, "an output after the request's end"
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
        if on_emit is not None:
            on_emit(outputs)

    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        engine.step_overlapped(emit)
    emit(engine.take_outputs())
    assert not engine.has_unfinished()
    return tokens, reasons


def test_overlapped_steps_give_each_stream_the_tokens_of_plain_steps():
    prompts = [prompt(n, start=50 * n) for n in (3, 9, 30, 5)]
    params = [make_params(max_tokens=n) for n in (20, 4, 9, 1)]
    reference = make_engine().generate(prompts, params)
    engine = make_engine(max_num_seqs=3)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    tokens, reasons = run_overlapped(engine)
    assert [tokens[f"r{i}"] for i in range(4)] == reference
    assert set(reasons.values()) == {FinishReason.LENGTH}
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


class _UnqueuedRunner(FakeRunner):
    can_follow = False  # a device that takes one launch at a time


def test_a_steps_outputs_go_out_while_the_next_step_computes():
    config = make_config()
    engine = Engine(config, _UnqueuedRunner(config))
    runner = engine.runner
    calls: list[str] = []
    real_launch, real_collect = runner.launch, runner.collect
    runner.launch = lambda plan: (calls.append("launch"), real_launch(plan))[1]
    runner.collect = lambda: (calls.append("collect"), real_collect())[1]
    engine.add_request("a", prompt(4), make_params(max_tokens=3))

    def emit(outputs):
        calls.append(f"emit {sum(len(o.new_token_ids) for o in outputs)}")

    for _ in range(3):
        engine.step_overlapped(emit)
    engine.step_overlapped(emit)  # nothing left to run: the last token goes out at once
    # Each step's token is emitted between the next launch and its collect.
    assert calls == ["launch", "emit 0", "collect", "launch", "emit 1", "collect",
                     "launch", "emit 1", "collect", "emit 1"]
    assert not engine.has_unfinished()


def test_a_stream_paused_while_its_next_token_computes_never_passes_its_credit():
    """The worker pauses a stream from emit once it has sent its credit; that stream is in
    the plan already launched, so the token computed for it then must be dropped (and
    computed again on resume), or the stream would get one token past its credit."""
    reference = make_engine().generate([prompt(6)], make_params(max_tokens=12))[0]
    engine = make_engine()
    engine.add_request("a", prompt(6), make_params(max_tokens=12))
    credit = 5
    sent: list[int] = []

    def on_emit(outputs):
        for out in outputs:
            sent.extend(out.new_token_ids)
        assert len(sent) <= credit
        if len(sent) == credit:
            engine.pause("a")

    tokens: dict[str, list[int]] = {}

    def emit(outputs):
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        on_emit(outputs)

    for _ in range(20):
        engine.step_overlapped(emit)
    assert sent == reference[:credit]
    credit = 12
    engine.resume("a")
    result, _ = run_overlapped(engine, on_emit)
    assert sent == reference
    assert tokens["a"] + result["a"] == reference


def test_an_abort_after_a_step_reports_its_tokens_once_with_the_abort():
    engine = make_engine()
    engine.add_request("a", prompt(4), make_params(max_tokens=50))
    engine.add_request("b", prompt(4, start=700), make_params(max_tokens=50))
    seen: list[tuple[str, int, FinishReason | None]] = []

    def emit(outputs):
        seen.extend((o.request_id, len(o.new_token_ids), o.finish_reason) for o in outputs)

    for _ in range(4):
        engine.step_overlapped(emit)
    num_a = sum(n for rid, n, _ in seen if rid == "a")
    assert engine.abort("a")  # a's last token is still held back
    engine.step_overlapped(emit)
    a_after = [(n, reason) for rid, n, reason in seen[len(seen) - 2:] if rid == "a"]
    assert a_after == [(1, FinishReason.ABORT)]
    assert num_a + 1 == 4
    engine.abort("b")
    emit(engine.take_outputs())
    assert [rid for rid, _, reason in seen if reason is not None] == ["a", "b"]
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_an_abort_of_a_request_finished_in_the_last_step_takes_its_held_finish():
    """A request that finished in the last step (its finish held back) and is aborted: the
    worker counts on one report for that abort, so the held finish is it, and a new request
    of the same id added then gets only its own outputs."""
    engine = make_engine()
    engine.add_request("a", prompt(4), make_params(max_tokens=2))
    seen: list[tuple[str, list[int], FinishReason | None]] = []

    def emit(outputs):
        seen.extend((o.request_id, o.new_token_ids, o.finish_reason) for o in outputs)

    engine.step_overlapped(emit)
    engine.step_overlapped(emit)  # "a" finishes here; its last token is held back
    assert engine.abort("a")
    assert not engine.abort("a")  # one report only
    num_seen = len(seen)
    engine.add_request("a", prompt(4), make_params(max_tokens=5))
    while engine.has_unfinished():
        engine.step_overlapped(emit)
    emit(engine.take_outputs())
    # The old one's finish with its last token, then the new one's five tokens and finish.
    assert [(len(t), reason) for _, t, reason in seen[num_seen:] if t or reason] == [
        (1, FinishReason.LENGTH), *[(1, None)] * 4, (1, FinishReason.LENGTH)]
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
