"""Fairness across flows in the worker's scheduler (worker/priority_policy.py, issue 39): a
client (SUBMIT.flow) holding a full batch cannot keep another client's request waiting for
one of its own to finish, and priority still comes first."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from tests.worker.factories import make_scheduler, make_seq, prompt, run_step
from zeroserve.worker.sequence import SequenceStatus

pytestmark = pytest.mark.timeout(60)


_starts = itertools.count(100, 100)  # a prompt of its own for every request


def add(scheduler, flow, num_prompt_tokens=6, max_tokens=20, priority=0):
    start = next(_starts)
    seq = make_seq(prompt_token_ids=prompt(num_prompt_tokens, start=start),
                   max_tokens=max_tokens)
    seq.priority, seq.flow = priority, flow
    scheduler.add(seq)
    return seq


def running_flows(scheduler) -> Counter:
    return Counter(seq.flow for seq in scheduler.running)


def chunk_ids(plan) -> list[str]:
    return [chunk.request_id for chunk in plan.chunks]


def test_a_light_flow_takes_a_full_batchs_slot_from_the_flow_holding_it_at_once():
    """Key A fills the batch; key B's one request starts in the very next step, in the slot
    of A's newest request, which waits at the front and finishes whole later."""
    scheduler, runner = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    a = [add(scheduler, flow=1, max_tokens=30) for _ in range(6)]
    run_step(scheduler, runner)
    assert running_flows(scheduler) == {1: 4}
    b = add(scheduler, flow=2, max_tokens=3)
    plan, _ = run_step(scheduler, runner)
    assert plan.preempted == [a[3].request_id]  # the newest of A's running
    assert b.request_id in chunk_ids(plan) and a[3].request_id not in chunk_ids(plan)
    assert running_flows(scheduler) == {1: 3, 2: 1}
    assert list(scheduler.waiting)[0] is a[3]  # ahead of A's others
    while scheduler.has_unfinished():
        run_step(scheduler, runner)
    assert [s.num_output_tokens for s in a] == [30] * 6 and b.num_output_tokens == 3


def test_one_flow_keeps_the_fifo_and_never_preempts_for_a_slot():
    scheduler, runner = make_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    seqs = [add(scheduler, flow=5, max_tokens=4 + i % 3) for i in range(9)]
    order = []
    while scheduler.has_unfinished():
        plan, _ = run_step(scheduler, runner)
        order += [rid for rid in chunk_ids(plan) if rid not in order]
    assert order == [s.request_id for s in seqs]
    assert scheduler.num_preemptions == 0


def test_a_flow_one_slot_behind_does_not_preempt():
    """Shares within one slot are fair enough: nobody is preempted (no thrashing)."""
    scheduler, runner = make_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    add(scheduler, flow=1, max_tokens=30)
    add(scheduler, flow=1, max_tokens=30)
    add(scheduler, flow=2, max_tokens=30)
    run_step(scheduler, runner)
    late = add(scheduler, flow=2, max_tokens=3)  # B holds 1 slot, A 2: one behind
    for _ in range(5):
        plan, _ = run_step(scheduler, runner)
        assert plan.preempted == []
    assert late.status is SequenceStatus.WAITING


@pytest.mark.parametrize("seed", range(12))
def test_backlogged_flows_share_the_batch_within_a_slot_over_random_arrival_orders(seed):
    """Three keys with more requests than slots, arriving in a random order and at random
    times: in every step, a key that still has requests waiting holds at most one slot
    fewer than the key holding the most, and while all three wait each gets a third of the
    slot-steps within a tolerance."""
    rng = random.Random(seed)
    scheduler, runner = make_scheduler(max_num_seqs=6, max_num_batched_tokens=256,
                                       num_kv_blocks=512)
    arrivals = [flow for flow in (1, 2, 3) for _ in range(12)]
    rng.shuffle(arrivals)
    slot_steps: Counter = Counter()
    num_steps = num_unfair_steps = 0
    flow_of = {}
    while arrivals or scheduler.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if arrivals:
                seq = add(scheduler, flow=arrivals.pop(), max_tokens=rng.randint(5, 15))
                flow_of[seq.request_id] = seq.flow
        if not scheduler.has_unfinished():
            continue
        plan, _ = run_step(scheduler, runner)
        held = Counter(flow_of[rid] for rid in chunk_ids(plan))  # the step's batch
        still_waiting = {seq.flow for seq in scheduler.waiting}
        if still_waiting:
            num_steps += 1
            # One slot changes hands per step, so a gap of 2 or more lasts a step at most
            # unless arrivals opened a wider one.
            gap = max(max(held.values()) - held[flow] for flow in still_waiting)
            num_unfair_steps += gap > 1
            assert gap <= 3, (held, still_waiting)
        if len(still_waiting) == 3:
            slot_steps.update(held)
    assert num_unfair_steps <= 0.15 * num_steps, (num_unfair_steps, num_steps)
    total = sum(slot_steps.values())
    assert total >= 6 * 10
    for flow in (1, 2, 3):
        assert abs(slot_steps[flow] / total - 1 / 3) < 0.06, slot_steps


def test_priority_beats_flow_fairness():
    """A critical key holding the whole batch is not preempted for a standard key's share;
    a critical request takes a standard one's slot even from a flow holding fewer."""
    scheduler, runner = make_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    critical = [add(scheduler, flow=1, priority=-1, max_tokens=10) for _ in range(3)]
    run_step(scheduler, runner)
    standard = add(scheduler, flow=2, max_tokens=10)
    for _ in range(3):
        plan, _ = run_step(scheduler, runner)
        assert plan.preempted == [] and standard.status is SequenceStatus.WAITING
    while any(s.status is not SequenceStatus.FINISHED for s in critical):
        run_step(scheduler, runner)
    # Now standard flows 2 (two slots) and 3 (one): a critical request of flow 3 takes a
    # slot, and it is the worst priority's largest flow that gives it, not flow 3's own.
    scheduler.abort(standard.request_id)
    big = [add(scheduler, flow=2, max_tokens=30) for _ in range(2)]
    small = add(scheduler, flow=3, max_tokens=30)
    run_step(scheduler, runner)
    assert running_flows(scheduler) == {2: 2, 3: 1}
    urgent = add(scheduler, flow=3, priority=-1, max_tokens=3)
    plan, _ = run_step(scheduler, runner)
    assert plan.preempted == [big[1].request_id]
    assert urgent.request_id in chunk_ids(plan)
    assert small.status is SequenceStatus.RUNNING


def test_under_kv_pressure_the_flow_holding_the_most_gives_its_blocks():
    """Blocks run out: the victim is the newest of the flow with the most running
    sequences, not the newest of all (which belongs to the light flow)."""
    scheduler, runner = make_scheduler(num_kv_blocks=9, block_size=4, max_num_seqs=4,
                                       max_num_batched_tokens=64)
    heavy = [add(scheduler, flow=1, num_prompt_tokens=8, max_tokens=12) for _ in range(3)]
    light = add(scheduler, flow=2, num_prompt_tokens=8, max_tokens=12)  # the newest
    run_step(scheduler, runner)  # 2 blocks each; one block free
    plan, _ = run_step(scheduler, runner)  # all four cross into a third block
    assert plan.preempted and light.request_id not in plan.preempted
    assert plan.preempted[0] == heavy[2].request_id
    while scheduler.has_unfinished():
        run_step(scheduler, runner)
    assert [s.num_output_tokens for s in (*heavy, light)] == [12] * 4


@pytest.mark.parametrize("priority", [0, -1], ids=["same-class", "critical"])
def test_n_choices_of_one_prompt_take_a_slot_only_when_they_can_start(priority):
    """Key B (of A's class, or critical) asks for 2 choices of one long prompt (two
    sequences, one prompt) while key A holds the batch: the second waits for the first's prefill to fill the prefix cache, and
    no request of A's is preempted for it meanwhile only to take its slot straight back
    (a wasted recompute each step); no slot stays empty either. One preemption per
    choice."""
    scheduler, runner = make_scheduler(max_num_seqs=4, max_num_batched_tokens=8)
    a = [add(scheduler, flow=1, max_tokens=40) for _ in range(6)]
    for _ in range(3):
        run_step(scheduler, runner)
    assert running_flows(scheduler) == {1: 4}
    shared = prompt(24, start=5000)  # 6 blocks: a prefill of several steps at this budget
    b = []
    for _ in range(2):
        seq = make_seq(prompt_token_ids=list(shared), max_tokens=5)
        seq.flow, seq.priority = 2, priority
        scheduler.add(seq)
        b.append(seq)
    while any(seq.status is not SequenceStatus.FINISHED for seq in b):
        plan, _ = run_step(scheduler, runner)
        assert not set(plan.preempted) & set(chunk_ids(plan)), plan.preempted  # no bounce
        assert len(plan.chunks) == 4  # every slot used
    assert scheduler.num_preemptions == 2
    assert b[1].num_cached_tokens >= 20  # the second choice read the first's prompt
    while scheduler.has_unfinished():
        run_step(scheduler, runner)
    assert [s.num_output_tokens for s in a] == [40] * 6
