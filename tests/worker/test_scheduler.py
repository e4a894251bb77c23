from __future__ import annotations

import random

import pytest

from tests.worker.factories import (
    FakeClock,
    make_engine,
    make_params,
    make_scheduler,
    make_seq,
    prompt,
    run_step,
)
from zeroserve.worker.config import BatchingMode
from zeroserve.worker.sequence import FinishReason, RequestError, SequenceStatus
from zeroserve.worker.speculative import SpeculativeConfig

pytestmark = pytest.mark.timeout(60)


def add(scheduler, num_prompt_tokens=8, start=None, priority=0, **params):
    start = 100 * (len(scheduler._requests) + 1) if start is None else start
    seq = make_seq(prompt_token_ids=prompt(num_prompt_tokens, start=start), **params)
    seq.priority = priority
    scheduler.add(seq)
    return seq


def run_until_idle(scheduler, runner, max_steps=5000):
    plans = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return plans
        plan, _ = run_step(scheduler, runner)
        plans.append(plan)
    raise AssertionError("scheduler did not drain")


def test_each_step_respects_the_token_budget_and_the_sequence_cap():
    scheduler, runner = make_scheduler(max_num_batched_tokens=20, max_num_seqs=3)
    seqs = [add(scheduler, 9, max_tokens=6) for _ in range(7)]
    plans = run_until_idle(scheduler, runner)
    assert all(p.num_tokens <= 20 and len(p.chunks) <= 3 for p in plans)
    assert max(p.num_tokens for p in plans) == 20  # the budget is actually used
    assert all(s.num_output_tokens == 6 and s.finish_reason is FinishReason.LENGTH for s in seqs)


def test_decodes_come_before_prefill_chunks():
    scheduler, runner = make_scheduler(max_num_batched_tokens=16)
    first = add(scheduler, 6, max_tokens=10)
    second = add(scheduler, 6, max_tokens=10)
    run_step(scheduler, runner)  # both prefilled
    late = add(scheduler, 40, max_tokens=2)
    plan, _ = run_step(scheduler, runner)
    assert [c.request_id for c in plan.chunks] == [
        first.request_id,
        second.request_id,
        late.request_id,
    ]
    assert [len(c.token_ids) for c in plan.chunks] == [1, 1, 14]
    assert [c.do_sample for c in plan.chunks] == [True, True, False]


def test_a_long_prompt_is_chunked_while_running_streams_keep_decoding():
    scheduler, runner = make_scheduler(max_num_batched_tokens=16, max_model_len=512)
    streams = [add(scheduler, 4, max_tokens=40) for _ in range(2)]
    run_step(scheduler, runner)
    long = add(scheduler, 100, max_tokens=3)
    steps_to_prefill = 0
    while long.num_output_tokens == 0:
        before = [s.num_output_tokens for s in streams]
        plan, _ = run_step(scheduler, runner)
        steps_to_prefill += 1
        # Every step: one new token per running stream, and the prompt advances by the rest.
        assert [s.num_output_tokens for s in streams] == [n + 1 for n in before]
        assert plan.num_tokens <= 16
    assert steps_to_prefill == -(-100 // 14)
    assert long.num_computed_tokens == 100


@pytest.mark.parametrize("cap", [12, None])
def test_beside_decodes_prompts_advance_in_chunks_of_the_prefill_cap(cap):
    # A step's time is about its token count and every running stream waits for all of it,
    # so beside decodes a prompt takes at most `cap` tokens a step; alone, the whole budget.
    scheduler, runner = make_scheduler(max_num_batched_tokens=40, num_kv_blocks=200,
                                       max_prefill_tokens_with_decodes=cap, max_model_len=512)
    stream = add(scheduler, 60, max_tokens=50)
    plan, _ = run_step(scheduler, runner)
    assert plan.num_tokens == 40  # nothing decodes yet: the whole budget
    run_step(scheduler, runner)
    assert stream.num_output_tokens == 1
    long = add(scheduler, 100, max_tokens=3)
    chunk_sizes = []
    while long.num_output_tokens == 0:
        before = stream.num_output_tokens
        plan, _ = run_step(scheduler, runner)
        assert stream.num_output_tokens == before + 1  # the stream gets a token every step
        chunk_sizes.append(len(plan.chunks[1].token_ids))
    per_step = 39 if cap is None else cap
    assert chunk_sizes == [per_step] * (100 // per_step) + ([100 % per_step] if 100 % per_step else [])


def test_a_burst_beside_many_running_streams_is_admitted_by_as_many_a_step():
    # 40 streams running, a cap of 12: a burst of 60 one-token prompts gets in 40 a step
    # (as many as there are decodes, the step at most twice a decode step), not 12.
    scheduler, runner = make_scheduler(max_num_batched_tokens=200, max_num_seqs=200,
                                       num_kv_blocks=400, max_prefill_tokens_with_decodes=12,
                                       max_model_len=512)
    running = [add(scheduler, 1, max_tokens=50) for _ in range(40)]
    run_step(scheduler, runner)
    assert all(s.num_output_tokens == 1 for s in running)
    burst = [add(scheduler, 1, max_tokens=50) for _ in range(60)]
    steps = 0
    while any(s.num_output_tokens == 0 for s in burst):
        num_decodes = sum(s.num_output_tokens > 0 for s in running + burst)
        plan, _ = run_step(scheduler, runner)
        steps += 1
        assert plan.num_tokens - num_decodes <= max(12, num_decodes)
    assert steps == 2  # 40, then 20 (5 steps of 12 with a fixed cap)


def test_the_prefill_cap_must_be_positive():
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes"):
        make_scheduler(max_prefill_tokens_with_decodes=0)


def test_a_finished_slot_is_refilled_in_the_next_plan():
    scheduler, runner = make_scheduler(max_num_seqs=2)
    short = add(scheduler, 4, max_tokens=1)
    long = add(scheduler, 4, max_tokens=5)
    queued = add(scheduler, 4, max_tokens=2)
    _, changed = run_step(scheduler, runner)
    assert short.finish_reason is FinishReason.LENGTH and short in changed
    plan, _ = run_step(scheduler, runner)
    assert [c.request_id for c in plan.chunks] == [long.request_id, queued.request_id]


def test_stop_conditions_eos_stop_ids_and_min_tokens():
    scheduler, runner = make_scheduler()
    runner.eos_after = 2  # the third output token of everyone is EOS
    eos = add(scheduler, 4, max_tokens=10)
    ignored = add(scheduler, 4, max_tokens=10, ignore_eos=True)
    late = add(scheduler, 4, max_tokens=10, min_tokens=3)
    run_until_idle(scheduler, runner)
    assert eos.finish_reason is FinishReason.STOP and eos.num_output_tokens == 3
    assert ignored.finish_reason is FinishReason.LENGTH and ignored.num_output_tokens == 10
    # EOS as the 3rd token is ignored under min_tokens=3; the fake never sends another.
    assert late.finish_reason is FinishReason.LENGTH and late.num_output_tokens == 10

    scheduler, runner = make_scheduler()
    probe = add(scheduler, 4, max_tokens=3, start=7)
    run_until_idle(scheduler, runner)
    stop_id = probe.output_token_ids[1]
    stopped = add(scheduler, 4, max_tokens=10, start=7, stop_token_ids=(stop_id,))
    run_until_idle(scheduler, runner)
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.output_token_ids == probe.output_token_ids[:2]


def test_requests_longer_than_max_model_len_are_rejected_at_add():
    scheduler, _ = make_scheduler(max_model_len=100)
    with pytest.raises(RequestError) as error:
        add(scheduler, 90, max_tokens=20)
    assert "maximum context length is 100 tokens" in str(error.value)
    assert "you requested 110 tokens (90 in the messages, 20 in the completion)" in str(error.value)
    with pytest.raises(RequestError, match="at least one token"):
        scheduler.add(make_seq(prompt_token_ids=[]))
    add(scheduler, 90, max_tokens=10)  # exactly at the limit is fine
    assert scheduler.num_unfinished == 1


def test_a_request_that_cannot_fit_the_pool_alone_is_rejected_not_looped():
    scheduler, _ = make_scheduler(num_kv_blocks=4, block_size=4, max_model_len=1000)
    with pytest.raises(RequestError, match="KV cache"):
        add(scheduler, 10, max_tokens=7)
    add(scheduler, 10, max_tokens=6)


def test_duplicate_ids_are_rejected():
    scheduler, _ = make_scheduler()
    scheduler.add(make_seq(request_id="x"))
    with pytest.raises(RequestError, match="already in use"):
        scheduler.add(make_seq(request_id="x"))


def test_preemption_under_a_tiny_pool_finishes_everything_with_correct_counts():
    scheduler, runner = make_scheduler(
        num_kv_blocks=10, block_size=4, max_num_seqs=6, max_num_batched_tokens=24
    )
    seqs = [add(scheduler, 5 + 3 * i, max_tokens=12 + i) for i in range(6)]
    plans = run_until_idle(scheduler, runner)
    assert scheduler.num_preemptions > 0
    assert any(p.preempted for p in plans)
    assert [s.num_output_tokens for s in seqs] == [12 + i for i in range(6)]
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)
    assert scheduler.block_manager.num_free_blocks == 10


def test_preemption_takes_the_newest_sequence_and_requeues_it_first():
    scheduler, runner = make_scheduler(num_kv_blocks=7, block_size=4, max_num_seqs=4)
    oldest = add(scheduler, 8, max_tokens=12)
    middle = add(scheduler, 8, max_tokens=12)
    newest = add(scheduler, 8, max_tokens=12)
    waiting = add(scheduler, 8, max_tokens=12)
    run_step(scheduler, runner)  # three take 2 blocks each; the fourth does not fit
    assert waiting.status is SequenceStatus.WAITING
    outputs_before = list(newest.output_token_ids)
    # Next step all three cross into a third block; only one block is free.
    plan, _ = run_step(scheduler, runner)
    assert plan.preempted == [newest.request_id]
    assert [c.request_id for c in plan.chunks] == [oldest.request_id, middle.request_id]
    assert newest.status is SequenceStatus.WAITING and newest.block_table == []
    assert scheduler.waiting[0] is newest  # ahead of the never-admitted request
    assert outputs_before  # what it generated is kept, and recomputed as context later
    run_until_idle(scheduler, runner)
    assert newest.output_token_ids[: len(outputs_before)] == outputs_before
    assert [s.num_output_tokens for s in (oldest, middle, newest, waiting)] == [12] * 4


def test_pause_keeps_blocks_out_of_the_batch_and_resume_rejoins():
    scheduler, runner = make_scheduler()
    paused = add(scheduler, 6, max_tokens=10)
    other = add(scheduler, 6, max_tokens=10)
    run_step(scheduler, runner)
    table = list(paused.block_table)
    free_before = scheduler.block_manager.num_free_blocks
    assert scheduler.pause(paused.request_id)
    for _ in range(3):
        plan, _ = run_step(scheduler, runner)
        assert [c.request_id for c in plan.chunks] == [other.request_id]
    assert paused.block_table == table and paused.num_output_tokens == 1
    assert scheduler.block_manager.num_free_blocks <= free_before
    assert scheduler.resume(paused.request_id)
    plan, _ = run_step(scheduler, runner)
    assert paused.request_id in [c.request_id for c in plan.chunks]
    assert plan.chunks[-1].start_pos == 6  # continues where it stopped, no recompute
    assert not scheduler.pause("unknown") and not scheduler.resume("unknown")


def test_resume_never_pushes_the_batch_past_max_num_seqs():
    scheduler, runner = make_scheduler(max_num_seqs=2)
    paused = add(scheduler, 6, max_tokens=10)
    run_step(scheduler, runner)
    scheduler.pause(paused.request_id)
    a, b = add(scheduler, 6, max_tokens=10), add(scheduler, 6, max_tokens=10)
    run_step(scheduler, runner)  # a and b fill the batch meanwhile
    assert scheduler.resume(paused.request_id)
    assert len(scheduler.running) == 2 and scheduler.waiting[0] is paused
    assert paused.block_table == []  # its blocks went back; it takes the next free slot
    run_until_idle(scheduler, runner)
    assert [s.num_output_tokens for s in (paused, a, b)] == [10] * 3


def test_usage_cached_tokens_are_those_of_the_first_admission():
    scheduler, runner = make_scheduler(num_kv_blocks=7, block_size=4, max_num_seqs=4)
    first = add(scheduler, 8, max_tokens=12)
    second = add(scheduler, 8, max_tokens=12)
    paused = add(scheduler, 8, max_tokens=12)
    run_step(scheduler, runner)
    assert paused.num_cached_tokens == 0
    scheduler.pause(paused.request_id)
    run_step(scheduler, runner)  # preempted: its full blocks stay in the prefix cache
    scheduler.resume(paused.request_id)
    run_until_idle(scheduler, runner)
    assert paused.num_preemptions >= 1
    assert paused.num_cached_tokens == 0  # not the blocks it found again of its own
    assert [s.num_output_tokens for s in (first, second)] == [12, 12]


def test_a_paused_sequence_is_preempted_before_a_running_one():
    scheduler, runner = make_scheduler(num_kv_blocks=7, block_size=4, max_num_seqs=4)
    first = add(scheduler, 8, max_tokens=12)
    second = add(scheduler, 8, max_tokens=12)
    paused = add(scheduler, 8, max_tokens=12)
    run_step(scheduler, runner)
    scheduler.pause(paused.request_id)
    plan, _ = run_step(scheduler, runner)  # both running streams need a third block
    assert plan.preempted == [paused.request_id]
    assert [c.request_id for c in plan.chunks] == [first.request_id, second.request_id]
    assert paused.status is SequenceStatus.PAUSED and paused.block_table == []
    scheduler.resume(paused.request_id)
    assert scheduler.waiting[0] is paused  # recomputes once there is room again
    run_until_idle(scheduler, runner)
    assert [s.num_output_tokens for s in (first, second, paused)] == [12] * 3


def test_abort_frees_blocks_immediately():
    scheduler, runner = make_scheduler()
    seq = add(scheduler, 30, max_tokens=10)
    run_step(scheduler, runner)
    assert scheduler.block_manager.num_used_blocks > 0
    assert scheduler.abort(seq.request_id) is seq
    assert seq.finish_reason is FinishReason.ABORT and seq.block_table == []
    assert scheduler.block_manager.num_used_blocks == 0
    assert scheduler.abort(seq.request_id) is None
    assert scheduler.schedule().is_empty


def test_a_fully_cached_prompt_recomputes_only_its_last_block():
    scheduler, runner = make_scheduler()
    first = add(scheduler, 12, start=500, max_tokens=1)
    run_until_idle(scheduler, runner)
    again = add(scheduler, 12, start=500, max_tokens=1)
    plan, _ = run_step(scheduler, runner)
    assert plan.chunks[0].start_pos == 8 and plan.chunks[0].token_ids == prompt(12, start=500)[8:]
    assert again.num_cached_tokens == 8
    assert again.output_token_ids == first.output_token_ids


def test_static_batches_wait_for_the_slowest_and_pad_finished_members():
    scheduler, runner = make_scheduler(batching_mode=BatchingMode.STATIC, max_num_seqs=3)
    quick = add(scheduler, 5, max_tokens=2)
    slow = add(scheduler, 30, max_tokens=6)
    plan, _ = run_step(scheduler, runner)
    # Whole prompts together, beyond the continuous token budget is fine in static mode.
    assert sorted(len(c.token_ids) for c in plan.chunks) == [5, 30]
    late = add(scheduler, 4, max_tokens=2)
    num_rows = []
    while slow.num_output_tokens < 6:
        plan, _ = run_step(scheduler, runner)
        num_rows.append(len(plan.chunks))
        assert late.request_id not in [c.request_id for c in plan.chunks]
    assert quick.finish_reason is FinishReason.LENGTH and quick.num_output_tokens == 2
    assert num_rows == [2] * 5  # the finished member still costs a row each step
    assert quick.block_table == []  # released once the batch ended
    plan, _ = run_step(scheduler, runner)
    assert [c.request_id for c in plan.chunks] == [late.request_id]


def test_dynamic_batches_gather_for_the_wait_window_then_run_to_completion():
    clock = FakeClock(10.0)
    scheduler, runner = make_scheduler(
        clock=clock, batching_mode=BatchingMode.DYNAMIC, batch_wait_ms=50.0, max_num_seqs=3
    )
    first = add(scheduler, 4, max_tokens=2)
    clock.now += 0.02
    second = add(scheduler, 4, max_tokens=5)
    assert scheduler.schedule().is_empty  # 20 ms since the first arrival: keep gathering
    scheduler.update(scheduler._last_plan, [])
    clock.now += 0.031
    plan, _ = run_step(scheduler, runner)
    assert {c.request_id for c in plan.chunks} == {first.request_id, second.request_id}
    late = add(scheduler, 4, max_tokens=1)
    clock.now += 1.0
    while second.num_output_tokens < 5:
        first_was_finished = first.is_finished
        plan, _ = run_step(scheduler, runner)
        assert late.request_id not in [c.request_id for c in plan.chunks]
        if first_was_finished:
            assert first.request_id not in [c.request_id for c in plan.chunks]  # no padding
    plan, _ = run_step(scheduler, runner)
    assert [c.request_id for c in plan.chunks] == [late.request_id]


def test_dynamic_starts_at_once_when_max_num_seqs_are_waiting():
    scheduler, runner = make_scheduler(
        clock=FakeClock(), batching_mode=BatchingMode.DYNAMIC, batch_wait_ms=1e6, max_num_seqs=2
    )
    add(scheduler, 4)
    assert scheduler.schedule().is_empty
    scheduler.update(scheduler._last_plan, [])
    add(scheduler, 4)
    plan, _ = run_step(scheduler, runner)
    assert len(plan.chunks) == 2


def _plan_summary(plan):
    """A plan as a runner sees it, up to which free block each sequence was given."""
    return sorted((c.request_id, tuple(c.token_ids), c.start_pos, c.do_sample,
                   len(c.block_table), tuple(c.draft_token_ids or ()),
                   tuple(c.prompt_token_ids), tuple(c.output_token_ids)) for c in plan.chunks)


@pytest.mark.parametrize("churn, speculative", [(0.05, False), (0.4, False), (0.4, True)])
def test_decodes_made_by_update_are_the_plan_made_from_scratch(churn, speculative):
    """update() makes the next step's decode chunks while it holds each sequence (the chunks
    of the plan it spends, moved on by one token); the next schedule() takes them, following
    the pauses, resumes and aborts since, unless it cannot give exactly the plan step 1 would
    make. Under random arrivals, pauses, resumes, aborts and preemptions (a tight pool), every
    plan must equal that of a scheduler that always plans from scratch, and both shortcuts
    (nothing changed; streams left or joined) must be taken often. `churn`: the chance per
    step of a pause, and of resuming all. `speculative`: steps of up to 4 sequences carry
    drafts (an input-grounded fake accepts some), larger ones do not."""
    config = dict(num_kv_blocks=40, block_size=4, max_num_seqs=8, max_num_batched_tokens=24,
                  max_model_len=96)
    runner_kwargs = None
    if speculative:
        config["speculative_config"] = SpeculativeConfig(
            num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1,
            disable_by_batch_size=4)
        runner_kwargs = {"copy_context": True}
    fast, scratch = make_engine(runner_kwargs, **config), make_engine(runner_kwargs, **config)
    scratch.scheduler._next_decodes = lambda budget, max_seqs: None
    taken = {"unchanged": 0, "followed": 0}
    real_next_decodes = fast.scheduler._next_decodes

    def counting(budget, max_seqs):
        version = fast.scheduler._next_version
        changed = version is not None and version != fast.scheduler.running.version
        made = real_next_decodes(budget, max_seqs)
        if made is not None:
            taken["followed" if changed else "unchanged"] += 1
        return made

    fast.scheduler._next_decodes = counting
    rng = random.Random(7)
    next_id = 0
    live: list[str] = []
    for step in range(1500):
        ops = []
        if step < 300 and rng.random() < 0.3:
            tokens = [rng.randrange(3, 49152) for _ in range(rng.randrange(1, 30))]
            ops.append(("add", f"s{next_id}", tokens, rng.randrange(1, 96 - len(tokens))))
            next_id += 1
        if live and rng.random() < 0.03:
            ops.append(("abort", rng.choice(live)))
        if live and rng.random() < churn:
            ops.append(("pause", rng.choice(live)))
        if rng.random() < churn:
            ops.append(("resume_all",))
        plans = []
        for engine in (fast, scratch):
            for op in ops:
                if op[0] == "add":
                    engine.add_request(op[1], op[2], make_params(max_tokens=op[3]))
                elif op[0] == "abort":
                    engine.abort(op[1])
                elif op[0] == "pause":
                    engine.pause(op[1])
                else:
                    for rid in list(engine.scheduler.paused):
                        engine.resume(rid)
            plan = engine.scheduler.schedule()
            plans.append(_plan_summary(plan))  # as it runs: update() spends it
            engine.scheduler.update(plan, engine.runner.execute(plan))
        assert plans[0] == plans[1], f"step {step}"
        live = list(fast.scheduler._requests)
        if step >= 300 and not live:
            break
    assert fast.scheduler.num_preemptions > 0
    # (Speculative: the steps of up to 4 sequences plan from scratch, so fewer follow.)
    assert taken["unchanged"] > 100 and taken["followed"] > (5 if speculative else 10), taken
    if speculative:
        assert fast.scheduler.spec_stats.num_accepted_tokens > 0


# ---- priority (worker/priority_policy.py) ---------------------------------------------------


def test_admission_follows_priority_then_arrival():
    scheduler, runner = make_scheduler(max_num_seqs=1)
    first = add(scheduler, 6, max_tokens=2, priority=-1)  # (no one better: never preempted)
    run_step(scheduler, runner)  # first runs; the others wait for its slot
    late_low = add(scheduler, 6, max_tokens=2, priority=1)
    standard = add(scheduler, 6, max_tokens=2)
    critical = add(scheduler, 6, max_tokens=2, priority=-1)
    standard2 = add(scheduler, 6, max_tokens=2)
    assert list(scheduler.waiting) == [critical, standard, standard2, late_low]
    order = []
    for _ in range(40):
        plan, _ = run_step(scheduler, runner)
        for chunk in plan.chunks:
            if chunk.request_id not in order:
                order.append(chunk.request_id)
        if not scheduler.has_unfinished():
            break
    assert order == [s.request_id for s in (first, critical, standard, standard2, late_low)]


def test_a_lower_class_is_preempted_before_a_higher_even_when_older_and_scheduled():
    scheduler, runner = make_scheduler(num_kv_blocks=7, block_size=4, max_num_seqs=4)
    sheddable = add(scheduler, 8, max_tokens=12, priority=1)  # the oldest
    critical = add(scheduler, 8, max_tokens=12, priority=-1)
    standard = add(scheduler, 8, max_tokens=12)
    run_step(scheduler, runner)  # 2 blocks each; one block free
    # All three cross into a third block: the sheddable one (decoded first, as the oldest)
    # gives its blocks back, never the critical or the standard one.
    plan, _ = run_step(scheduler, runner)
    assert plan.preempted == [sheddable.request_id]
    assert sheddable.request_id not in [c.request_id for c in plan.chunks]
    assert sheddable.status is SequenceStatus.WAITING
    assert critical.status is standard.status is SequenceStatus.RUNNING
    run_until_idle(scheduler, runner)
    assert [s.num_output_tokens for s in (sheddable, critical, standard)] == [12] * 3


def test_a_preempted_sequence_waits_at_the_front_of_its_own_priority():
    scheduler, runner = make_scheduler(num_kv_blocks=7, block_size=4, max_num_seqs=3)
    add(scheduler, 8, max_tokens=12, priority=-1)
    add(scheduler, 8, max_tokens=12, priority=-1)
    low = add(scheduler, 8, max_tokens=12, priority=1)
    run_step(scheduler, runner)
    waiting_low = add(scheduler, 8, max_tokens=12, priority=1)
    waiting_high = add(scheduler, 8, max_tokens=12)
    plan, _ = run_step(scheduler, runner)
    assert plan.preempted == [low.request_id]
    assert list(scheduler.waiting) == [waiting_high, low, waiting_low]


def test_equal_priorities_keep_the_fifo_and_newest_victim():
    scheduler, runner = make_scheduler(num_kv_blocks=7, block_size=4, max_num_seqs=4)
    seqs = [add(scheduler, 8, max_tokens=12, priority=2) for _ in range(3)]
    run_step(scheduler, runner)
    plan, _ = run_step(scheduler, runner)
    assert plan.preempted == [seqs[-1].request_id]


def test_a_better_priority_takes_a_full_batchs_slot_from_the_worst():
    scheduler, runner = make_scheduler(max_num_seqs=2)
    old_low = add(scheduler, 6, max_tokens=30, priority=1)
    new_low = add(scheduler, 6, max_tokens=30, priority=1)
    run_step(scheduler, runner)
    same = add(scheduler, 6, max_tokens=2, priority=1)  # equal: waits its turn
    plan, _ = run_step(scheduler, runner)
    assert plan.preempted == [] and same.status is SequenceStatus.WAITING
    critical = add(scheduler, 6, max_tokens=2, priority=-1)
    plan, _ = run_step(scheduler, runner)
    assert plan.preempted == [new_low.request_id]  # the newest of the worst
    assert new_low.request_id not in [c.request_id for c in plan.chunks]
    # It starts in the very step that freed the slot; the victim waits at the front.
    assert critical.request_id in [c.request_id for c in plan.chunks]
    assert list(scheduler.waiting) == [new_low, same]
    assert old_low.status is SequenceStatus.RUNNING
    run_until_idle(scheduler, runner)
    assert [s.num_output_tokens for s in (old_low, new_low, same, critical)] == [30, 30, 2, 2]
