"""The gateway's fair queue (gateway/fair_queue.py): shares across classes and keys, a
burst behind its own requests, blocked heads passed over, bounded bookkeeping."""

from __future__ import annotations

import random
import sys
import tracemalloc
from collections import Counter

import pytest

from zeroserve.gateway.fair_queue import Entry, FairQueue

pytestmark = pytest.mark.timeout(120)


def entry(flow, rank=0, weight=1.0, payload=None) -> Entry:
    return Entry(payload if payload is not None else flow, rank, flow, weight, 0.0)


def served(fq: FairQueue, n: int) -> list:
    return [fq.pop().payload for _ in range(n)]


@pytest.mark.parametrize("seed", range(40))
def test_backlogged_keys_get_their_weighted_shares_whatever_the_arrival_order(seed):
    rng = random.Random(seed)
    weights = {"a": 1.0, "b": 1.0, "c": 2.0, "d": 4.0}
    arrivals = [flow for flow in weights for _ in range(300)]
    rng.shuffle(arrivals)
    fq = FairQueue([1.0], seed=seed)
    for flow in arrivals:
        fq.push(entry(flow, weight=weights[flow]))
    counts = Counter(served(fq, 400))  # all four stay backlogged throughout
    total = sum(weights.values())
    for flow, weight in weights.items():
        expected = 400 * weight / total
        assert abs(counts[flow] - expected) <= 0.05 * 400, (flow, counts)


@pytest.mark.parametrize("seed", range(20))
def test_backlogged_classes_get_their_shares(seed):
    rng = random.Random(seed)
    shares = [8.0, 4.0, 1.0]
    arrivals = [(rank, f"k{rng.randrange(5)}") for rank in range(3) for _ in range(400)]
    rng.shuffle(arrivals)
    fq = FairQueue(shares, seed=seed)
    for rank, flow in arrivals:
        fq.push(entry(flow, rank=rank, payload=rank))
    counts = Counter(served(fq, 390))
    for rank, share in enumerate(shares):
        assert abs(counts[rank] - 390 * share / sum(shares)) <= 0.05 * 390, counts


def test_a_burst_waits_behind_its_own_requests_not_in_front_of_another_keys():
    fq = FairQueue([1.0])
    for i in range(500):
        fq.push(entry("batch", payload=("batch", i)))
    served(fq, 10)  # the burst is being served
    fq.push(entry("interactive", payload=("interactive", 0)))
    assert ("interactive", 0) in served(fq, 2)
    # And the burst's own order is kept.
    rest = [p for p in served(fq, len(fq)) if p[0] == "batch"]
    assert rest == sorted(rest)


def test_a_flows_requests_keep_their_order_and_blocked_heads_keep_their_places():
    fq = FairQueue([1.0])
    for i in range(3):
        fq.push(entry("a", payload=("a", i)))
        fq.push(entry("b", payload=("b", i)))
    first = fq.pop(lambda e: e.payload[0] == "a")  # a's workers are busy
    assert first.payload == ("b", 0)
    assert [fq.pop().payload for _ in range(5)][:1] == [("a", 0)]


def test_removed_entries_are_never_served_and_pop_worst_takes_the_lowest_class_newest():
    fq = FairQueue([1.0, 1.0, 1.0])
    keep = [entry("x", rank=0, payload="x0"), entry("y", rank=1, payload="y0")]
    low = [entry("z", rank=2, payload=f"z{i}") for i in range(3)]
    for e in keep + low:
        fq.push(e)
    assert fq.remove(low[0]) and not fq.remove(low[0])
    assert fq.pop_worst(better_than=2) is None  # nothing below the lowest class
    assert fq.pop_worst(better_than=0).payload == "z2"
    assert fq.pop_worst(better_than=0).payload == "z1"
    assert fq.pop_worst(better_than=0).payload == "y0"
    assert fq.pop_worst(better_than=0) is None
    assert served(fq, 1) == ["x0"] and not fq


def test_a_flood_of_100000_distinct_keys_keeps_the_bookkeeping_bounded():
    fq = FairQueue([1.0, 1.0], max_flows=1024)
    tracemalloc.start()
    try:
        for i in range(100_000):  # each key sends one request and gives up
            e = entry(("ip", f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}"), rank=i % 2)
            fq.push(e)
            if i % 3:
                fq.remove(e)
            elif i % 2:
                fq.pop()
        assert fq.num_queues <= 2 * 2 * 1024
        assert all(len(c.heap) <= 3 * len(c.queues) + 64 for c in fq._classes)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # What is still queued is what was never taken out; the bookkeeping around it is
    # bounded by the queues, not by the 100,000 keys seen.
    assert peak < 40 * 1024 * 1024, peak
    num_left = len(fq)
    assert sum(1 for _ in fq.entries()) == num_left
    while fq:
        assert fq.pop() is not None
    assert fq.num_queues == 0 and sys.getsizeof(fq._classes[0].queues) < 100_000
