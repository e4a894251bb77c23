"""Steps planned behind the one computing (worker/scheduler_follow.py): with a runner whose
device queues launches, Engine.step_overlapped launches step n+1 before step n's tokens are
collected, so a step is the forward alone. Nothing a stream sees may differ from plain
steps: the same tokens, each once, never past its credit, whatever ends or leaves the batch
while a plan is computing behind another."""

from __future__ import annotations

import random

import pytest

from tests.worker.factories import make_engine, make_params, make_scheduler, prompt
from zeroserve.common.protocol import POISON_REQUEST
from zeroserve.worker.plan import SampledToken
from zeroserve.worker.sequence import FinishReason, Sequence
from zeroserve.worker.speculative import SpeculativeConfig

pytestmark = pytest.mark.timeout(120)


def count_followers(engine) -> list[int]:
    """Wrap the runner's launch; the returned list counts the followers launched."""
    runner = engine.runner
    real_launch = runner.launch
    followers = [0]

    def launch(plan):
        followers[0] += plan.prev_rows is not None
        real_launch(plan)

    runner.launch = launch
    return followers


def test_the_next_step_is_launched_before_the_last_ones_tokens_are_collected():
    engine = make_engine()
    runner = engine.runner
    calls: list[str] = []
    real_launch, real_collect = runner.launch, runner.collect

    def launch(plan):
        calls.append("follow" if plan.prev_rows is not None else "launch")
        real_launch(plan)

    runner.launch = launch
    runner.collect = lambda: (calls.append("collect"), real_collect())[1]
    reference = make_engine().generate([prompt(4)], make_params(max_tokens=4))[0]
    engine.add_request("a", prompt(4), make_params(max_tokens=4))
    tokens: list[int] = []

    def emit(outputs):
        tokens.extend(t for out in outputs for t in out.new_token_ids)
        calls.append(f"emit {sum(len(o.new_token_ids) for o in outputs)}")

    while engine.has_unfinished():
        engine.step_overlapped(emit)
    emit(engine.take_outputs())
    # The prefill runs alone; the first decode is planned as ever, and the next two each
    # launched behind the one computing (once the device has one in hand, the last step's
    # outputs go out first); the fourth token is the last (max_tokens), so no row is
    # launched behind its step.
    assert calls == ["launch", "emit 0", "collect",
                     "launch", "follow", "emit 1", "collect",
                     "emit 1", "follow", "collect",
                     "emit 1", "collect",
                     "emit 1", "emit 0"]
    assert tokens == reference
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_every_decode_step_is_launched_before_the_one_before_it_is_collected():
    """The period the relay needs: a device that queues launches always has the next
    decode step in hand when one ends, whatever the engine thread does meanwhile."""
    engine = make_engine(max_num_seqs=16, num_kv_blocks=256)
    for i in range(8):  # one prefill step (24 tokens), then 29 decode steps
        engine.add_request(f"r{i}", prompt(3, start=10 * i), make_params(max_tokens=30))
    runner = engine.runner
    queued: list[int] = []  # at each launch: the plans launched and not collected before it
    real_launch = runner.launch

    def launch(plan):
        queued.append(len(runner._launched))
        real_launch(plan)

    runner.launch = launch
    while engine.has_unfinished():
        engine.step_overlapped(lambda outputs: None)
    # The prefill and the first decode alone; each of the other 28 behind the one before.
    assert queued == [0, 0] + [1] * 28
    assert runner.num_steps == 30


def test_a_stream_resumed_while_steps_are_queued_rejoins_them_with_its_own_tokens():
    """A stream out of credit (paused from emit) and resumed later rejoins the steps
    launched behind each other: no step is planned from scratch for it (each launch after
    the first decode is queued behind the one before), and its tokens are a plain run's."""
    prompts = [prompt(4, start=10 * i) for i in range(3)]
    reference = make_engine().generate(prompts, make_params(max_tokens=16))
    engine = make_engine()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, make_params(max_tokens=16))
    runner = engine.runner
    queued: list[int] = []
    real_launch = runner.launch

    def launch(plan):
        queued.append(len(runner._launched))
        real_launch(plan)

    runner.launch = launch
    tokens: dict[str, list[int]] = {}
    credit = {"r0": 16, "r1": 5, "r2": 9}
    waits: dict[str, int] = {}

    def emit(outputs):
        for out in outputs:
            got = tokens.setdefault(out.request_id, [])
            got += out.new_token_ids
            assert len(got) <= credit[out.request_id]
            if len(got) == credit[out.request_id] and out.finish_reason is None:
                engine.pause(out.request_id)
                waits[out.request_id] = 2

    while engine.has_unfinished() or waits:
        for rid in list(waits):
            waits[rid] -= 1
            if waits[rid] < 0:
                del waits[rid]
                credit[rid] = 16
                engine.resume(rid)
        engine.step_overlapped(emit)
    emit(engine.take_outputs())
    assert [tokens[f"r{i}"] for i in range(3)] == reference
    assert queued[:2] == [0, 0] and set(queued[2:]) == {1}


@pytest.mark.parametrize("seed", range(16))
def test_followed_steps_give_every_stream_the_tokens_of_plain_steps(seed, caplog):
    """Streams that stop on a stop token (a row launched behind their last one), end by
    length, arrive while others decode, run out of credit and get it back, or are aborted,
    in a pool small enough to preempt: the tokens of plain steps, each once, and every block
    back. The fake runner checks every plan's KV contents."""
    rng = random.Random(seed)
    num_requests = 14
    prompts = [prompt(rng.randint(1, 9), start=100 * i) for i in range(num_requests)]
    plain = [make_params(max_tokens=rng.randint(1, 40), ignore_eos=True)
             for _ in range(num_requests)]
    free_run = make_engine().generate(prompts, plain)
    params = []
    for i, sp in enumerate(plain):  # about half stop on a token of their own
        stops = (free_run[i][rng.randrange(len(free_run[i]))],) if rng.random() < 0.5 else ()
        params.append(make_params(max_tokens=sp.max_tokens, stop_token_ids=stops,
                                  min_tokens=min(sp.max_tokens, rng.choice([0, 0, 2]))))
    reference = make_engine().generate(prompts, params)
    pool = rng.choice([14, 20, 256])
    engine = make_engine(max_num_seqs=rng.choice([4, 8, 16]), num_kv_blocks=pool,
                         max_num_batched_tokens=rng.choice([3, 32, 32]))
    followers = count_followers(engine)
    credit = {f"r{i}": rng.choice([3, 5, 100]) for i in range(num_requests)}
    paused: dict[str, int] = {}  # request id -> steps until its credit comes
    aborted: set[str] = set()
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}

    def emit(outputs):
        for out in outputs:
            assert out.request_id not in reasons, "an output after the request's end"
            got = tokens.setdefault(out.request_id, [])
            got += out.new_token_ids
            assert len(got) <= credit[out.request_id], "a token past the stream's credit"
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
            elif len(got) == credit[out.request_id]:
                assert engine.pause(out.request_id)
                paused[out.request_id] = rng.randint(0, 3)

    order = list(range(num_requests))
    for _ in range(2000):
        if order and rng.random() < 0.4:  # arrivals while others decode
            i = order.pop(0)
            engine.add_request(f"r{i}", prompts[i], params[i])
        for rid in list(paused):
            paused[rid] -= 1
            if paused[rid] < 0:
                del paused[rid]
                credit[rid] += rng.choice([2, 6])
                engine.resume(rid)
        if rng.random() < 0.05 and tokens:
            rid = rng.choice(sorted(tokens))
            if rid not in reasons and engine.abort(rid):
                aborted.add(rid)
                paused.pop(rid, None)
        if not order and not engine.has_unfinished():
            break
        engine.step_overlapped(emit)
    emit(engine.take_outputs())
    assert len(reasons) == num_requests
    for i in range(num_requests):
        rid = f"r{i}"
        if rid in aborted:
            assert reference[i][:len(tokens.get(rid, []))] == tokens.get(rid, [])
            assert reasons[rid] in (FinishReason.ABORT, FinishReason.STOP, FinishReason.LENGTH)
        else:
            assert tokens[rid] == reference[i], rid
    assert followers[0] > 0
    assert "launching a step behind" not in caplog.text
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
    assert not engine.has_launched_step()


def test_a_stream_that_stops_gets_a_row_behind_its_last_whose_token_is_dropped():
    scheduler, runner = make_scheduler()
    a, b = Sequence("a", prompt(3), make_params(max_tokens=10)), \
        Sequence("b", prompt(3, start=50), make_params(max_tokens=10))
    for seq in (a, b):
        scheduler.add(seq)
    plan = scheduler.schedule()
    scheduler.update(plan, runner.execute(plan))  # the prefills
    plan = scheduler.schedule()
    follower = scheduler.follow()
    assert [c.request_id for c in follower.chunks] == ["a", "b"]
    assert [c.start_pos for c in follower.chunks] == [4, 4]
    # "a" samples EOS (a stop); "b" a plain token: that token is the follower's input.
    changed = scheduler.update(plan, [SampledToken("a", 2), SampledToken("b", 777)])
    assert a.finish_reason is FinishReason.STOP and a in changed
    assert follower.chunks[1].token_ids == [777]
    # The follower's row for "a" computed its stop token: dropped, nothing changes for it.
    changed = scheduler.update(follower, [SampledToken("a", 5), SampledToken("b", 778)])
    assert changed == [b] and a.output_token_ids == [a.output_token_ids[0], 2]
    assert b.output_token_ids[-2:] == [777, 778] and b.num_computed_tokens == 5
    # Nothing is behind it now: the next plan is made as ever, without "a".
    assert [c.request_id for c in scheduler.schedule().chunks] == ["b"]


def test_a_stream_ending_by_length_gets_no_row_behind_its_last():
    scheduler, runner = make_scheduler()
    scheduler.add(Sequence("a", prompt(3), make_params(max_tokens=2)))
    scheduler.add(Sequence("b", prompt(3, start=50), make_params(max_tokens=9)))
    plan = scheduler.schedule()
    scheduler.update(plan, runner.execute(plan))
    scheduler.schedule()
    assert [c.request_id for c in scheduler.follow().chunks] == ["b"]


@pytest.mark.parametrize("case", ["penalty", "waiting", "speculating", "prefill"])
def test_no_step_is_planned_behind_one_where_it_could_differ(case):
    overrides = {"speculative_config": SpeculativeConfig()} if case == "speculating" else {}
    scheduler, runner = make_scheduler(**overrides)
    params = make_params(repetition_penalty=1.3) if case == "penalty" else make_params()
    scheduler.add(Sequence("a", prompt(3), params))
    plan = scheduler.schedule()
    if case != "prefill":
        scheduler.update(plan, runner.execute(plan))
        if case == "waiting":
            scheduler.add(Sequence("b", prompt(3, start=50), make_params()))
        scheduler.schedule()
    assert scheduler.follow() is None


def test_a_resumed_stream_is_not_followed_past_the_token_budget():
    scheduler, runner = make_scheduler(max_num_batched_tokens=3)
    a, b, c, d = (Sequence(rid, prompt(1, start=10 * k), make_params(max_tokens=20))
                  for k, rid in enumerate("abcd"))
    for seq in (a, b, c):
        scheduler.add(seq)
    plan = scheduler.schedule()
    scheduler.update(plan, runner.execute(plan))
    scheduler.pause("c")
    scheduler.add(d)
    plan = scheduler.schedule()  # a and b decode, d is admitted
    scheduler.update(plan, runner.execute(plan))
    plan = scheduler.schedule()
    assert [ch.request_id for ch in plan.chunks] == ["a", "b", "d"]
    scheduler.resume("c")  # 4 running, 3 tokens a step: a plan from scratch leaves one out
    assert scheduler.follow() is None


def test_a_step_behind_one_whose_streams_all_paused_is_still_collected():
    """The worker pauses every stream from emit (out of credit) while a step is launched
    behind: the engine still has that step to collect (the worker's loop steps on), and
    the streams go on with the right tokens when resumed."""
    reference = make_engine().generate([prompt(5)], make_params(max_tokens=12))[0]
    engine = make_engine()
    engine.add_request("a", prompt(5), make_params(max_tokens=12))
    tokens: list[int] = []

    def emit(outputs):
        for out in outputs:
            tokens.extend(out.new_token_ids)
        if len(tokens) >= 3:
            engine.pause("a")

    while not engine.has_launched_step():
        engine.step_overlapped(emit)
    while len(tokens) < 3:
        engine.step_overlapped(emit)
    assert engine.has_unfinished()
    while engine.has_launched_step():
        engine.step_overlapped(emit)
    assert tokens == reference[:3]
    engine.resume("a")
    while engine.has_unfinished():
        engine.step_overlapped(lambda outputs: tokens.extend(
            t for out in outputs for t in out.new_token_ids))
    tokens.extend(t for out in engine.take_outputs() for t in out.new_token_ids)
    assert tokens == reference


def test_a_request_that_fails_the_step_behind_which_another_was_launched_fails_alone():
    reference = make_engine().generate([prompt(4, start=10), prompt(6, start=20)],
                                       make_params(max_tokens=9))
    engine = make_engine()
    followers = count_followers(engine)
    runner = engine.runner
    real_launch, real_collect = runner.launch, runner.collect
    launched: list[list[str]] = []

    def launch(plan):
        launched.append([c.request_id for c in plan.chunks])
        real_launch(plan)

    def collect():
        ids = launched.pop(0)
        sampled = real_collect()
        if "poison" in ids and len(launched) == 1 and len(sampled) > 1:
            raise RuntimeError("device assert")  # a step with another behind it
        return sampled

    runner.launch, runner.collect = launch, collect
    engine.add_request("a", prompt(4, start=10), make_params(max_tokens=9))
    engine.add_request("b", prompt(6, start=20), make_params(max_tokens=9))
    engine.add_request("poison", prompt(5, start=30), make_params(max_tokens=9))
    tokens: dict[str, list[int]] = {}
    finished: dict[str, list] = {}

    def emit(outputs):
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished[out.request_id] = [out.finish_reason, out.error_code]

    for _ in range(40):
        if not engine.has_unfinished():
            break
        # poison fails every batch after its first tokens, but alone only once it is poison
        if len(tokens.get("poison", [])) >= 2:
            runner.execute = _failing_for("poison", runner.execute)
        engine.step_overlapped(emit)
    emit(engine.take_outputs())
    assert followers[0] > 0
    assert finished["poison"] == [FinishReason.ERROR, POISON_REQUEST]
    assert tokens["a"] == reference[0] and tokens["b"] == reference[1]
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def _failing_for(request_id, execute):
    if getattr(execute, "is_failing", False):
        return execute

    def failing(plan):
        if any(c.request_id == request_id for c in plan.chunks):
            raise RuntimeError("device assert")
        return execute(plan)

    failing.is_failing = True
    return failing


def test_a_step_that_raises_with_a_step_behind_it_leaves_nothing_of_either():
    """The worker fails every stream when a step raises (here its emit) and serves on: no
    step launched behind may stay on the device or come back as the plan of a later step."""
    engine = make_engine()
    followers = count_followers(engine)
    for i in range(3):
        engine.add_request(f"old{i}", prompt(4, start=40 * i), make_params(max_tokens=20))
    engine.step_overlapped(lambda outputs: None)  # the prefills

    def broken_emit(outputs):
        raise RuntimeError("the emit failed")

    with pytest.raises(RuntimeError, match="the emit failed"):
        engine.step_overlapped(broken_emit)  # planned from scratch, one launched behind it
    assert followers[0] == 1 and not engine.has_launched_step()
    assert not engine.runner._launched  # both collected
    engine.step_overlapped(lambda outputs: None)  # from scratch again, one behind it
    assert followers[0] == 2 and engine.has_launched_step()
    with pytest.raises(RuntimeError, match="the emit failed"):
        engine.step_overlapped(broken_emit)  # the queued one: its emit comes first
    assert followers[0] == 2 and not engine.has_launched_step()
    assert not engine.runner._launched
    for i in range(3):  # as the worker's _fail_all does
        engine.abort(f"old{i}")
    engine.take_outputs()
    prompts = [prompt(5, start=300), prompt(3, start=400)]
    reference = make_engine().generate(prompts, make_params(max_tokens=7))
    for i, p in enumerate(prompts):
        engine.add_request(f"new{i}", p, make_params(max_tokens=7))
    tokens: dict[str, list[int]] = {}

    def emit(outputs):
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    while engine.has_unfinished():
        engine.step_overlapped(emit)
    emit(engine.take_outputs())
    assert [tokens["new0"], tokens["new1"]] == reference
    assert followers[0] > 3
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
