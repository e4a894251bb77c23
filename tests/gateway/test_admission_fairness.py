"""Admission by priority class and fair share (gateway/admission.py): the order workers are
handed out in, shedding lowest class first, a higher class taking a lower one's place, the
key's class as a ceiling (gateway/key_limits.py's Priorities) and the queue's statistics."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.gateway.workers.test_registry import hello, route
from zeroserve.gateway.admission import Admission, Arrival, Ticket
from zeroserve.gateway.errors import APIError
from zeroserve.gateway.key_limits import RateLimitConfigError, load_priorities
from zeroserve.gateway.priority_classes import PriorityClasses
from zeroserve.gateway.workers.registry import WorkerRegistry

pytestmark = pytest.mark.timeout(60)
CRITICAL, STANDARD, SHEDDABLE = 0, 1, 2


def one_slot() -> WorkerRegistry:
    reg = WorkerRegistry(max_waiting_per_worker=0)
    reg.register(hello("a", max_num_seqs=1), route("a", max_num_seqs=1), 0.0)
    return reg


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def serve_all(reg, adm, first: str, order: list[str], n: int) -> None:
    """Free the one slot n times, noting who got it each time."""
    current = first
    for _ in range(n):
        reg.release("a", current)
        adm.wake()
        await settle()
        (current,) = reg.get("a").request_ids
        order.append(current)


def test_fair_mode_serves_another_keys_request_ahead_of_a_burst_and_fcfs_does_not():
    async def main(is_fair: bool) -> list[str]:
        reg = one_slot()
        adm = Admission(reg, max_queued=100, timeout_s=5, is_fair=is_fair)
        await adm.acquire("a-0", ticket=Ticket(STANDARD, 0))
        tasks = [asyncio.create_task(adm.acquire(f"a-{i}", ticket=Ticket(STANDARD, 0)))
                 for i in range(1, 21)]
        await settle()
        tasks.append(asyncio.create_task(adm.acquire("b-0", ticket=Ticket(STANDARD, 1))))
        await settle()
        order: list[str] = []
        await serve_all(reg, adm, "a-0", order, 21)
        await asyncio.gather(*tasks)
        return order

    fair = asyncio.run(main(True))
    assert fair.index("b-0") <= 1
    assert [r for r in fair if r.startswith("a")] == [f"a-{i}" for i in range(1, 21)]
    assert asyncio.run(main(False)).index("b-0") == 20  # FIFO: behind the whole burst


def test_the_lowest_class_is_shed_first_and_critical_takes_its_place():
    async def main():
        adm = Admission(WorkerRegistry(), max_queued=4, timeout_s=5)
        tasks = {}

        def queue(rid, rank, client=0):
            tasks[rid] = asyncio.create_task(adm.acquire(rid, ticket=Ticket(rank, client)))

        queue("s1", SHEDDABLE)
        queue("s2", SHEDDABLE)
        await settle()
        # Sheddable may fill half the queue: the third is refused, with Retry-After.
        with pytest.raises(APIError) as e:
            await adm.acquire("s3", ticket=Ticket(SHEDDABLE, 0))
        assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
        assert "sheddable" in e.value.message
        queue("t1", STANDARD)
        queue("t2", STANDARD)
        await settle()
        assert adm.num_queued == 4  # full
        queue("c1", CRITICAL, client=1)  # takes the newest sheddable request's place
        await settle()
        assert tasks["s2"].done() and tasks["s2"].exception().status == 429
        assert not tasks["s1"].done() and adm.num_queued == 4
        queue("t3", STANDARD)  # and a standard one takes the last sheddable's
        await settle()
        assert tasks["s1"].done() and tasks["s1"].exception().status == 429
        # Now only standard and critical wait: a standard request is refused, a critical
        # one takes a standard one's place.
        with pytest.raises(APIError):
            await adm.acquire("t4", ticket=Ticket(STANDARD, 0))
        queue("c2", CRITICAL, client=1)
        await settle()
        assert tasks["t3"].done() and tasks["t3"].exception().status == 429
        shed = {name: adm.stats.by_class[rank].num_shed
                for rank, name in enumerate(adm.classes.names)}
        assert shed == {"critical": 0, "standard": 2, "sheddable": 3}
        assert adm.stats.by_key["key-1"].num_shed == 0 and adm.stats.by_key["key-0"].num_shed == 5
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        assert adm.num_queued == 0
        assert all(f.num_queued == 0 for f in adm.stats.by_class)
    asyncio.run(main())


def test_fcfs_mode_never_sheds_by_class():
    async def main():
        adm = Admission(WorkerRegistry(), max_queued=2, timeout_s=5, is_fair=False)
        tasks = [asyncio.create_task(adm.acquire(f"s{i}", ticket=Ticket(SHEDDABLE)))
                 for i in range(2)]
        await settle()
        assert adm.num_queued == 2
        with pytest.raises(APIError) as e:
            await adm.acquire("c", ticket=Ticket(CRITICAL))
        assert e.value.code == "queue_full"
        assert not any(t.done() for t in tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.run(main())


def test_check_room_counts_the_places_a_higher_class_may_take():
    async def main():
        adm = Admission(WorkerRegistry(), max_queued=2, timeout_s=5)
        tasks = [asyncio.create_task(adm.acquire(f"s{i}", ticket=Ticket(STANDARD)))
                 for i in range(2)]
        await settle()
        adm.check_room(2, Ticket(CRITICAL))
        with pytest.raises(APIError):
            adm.check_room(1, Ticket(STANDARD))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.run(main())


def test_a_share_changed_at_run_time_changes_the_order():
    async def main():
        reg = one_slot()
        adm = Admission(reg, max_queued=100, timeout_s=5)
        await adm.acquire("x", ticket=Ticket(STANDARD, 9))
        tasks = [asyncio.create_task(adm.acquire(f"{kind}-{i}", ticket=Ticket(rank, i)))
                 for i in range(10) for kind, rank in (("t", STANDARD), ("s", SHEDDABLE))]
        await settle()
        assert adm.set_share("sheddable", 1000.0) and not adm.set_share("nope", 1.0)
        assert adm.shares()["sheddable"] == 1000.0
        order: list[str] = []
        await serve_all(reg, adm, "x", order, 20)
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(main())
    assert sum(1 for r in order[:10] if r.startswith("s")) >= 8


def test_a_flood_of_distinct_clients_keeps_labels_and_queues_bounded():
    async def main():
        adm = Admission(WorkerRegistry(), max_queued=500, timeout_s=5, max_flows=64)
        tasks = [asyncio.create_task(adm.acquire(f"r{i}", ticket=Ticket(
            i % 3, ("ip", f"10.0.{i >> 8}.{i & 255}") if i % 2 else i)))
            for i in range(5000)]
        await settle()
        assert adm.num_queued <= 500
        assert adm._queue.num_queues <= 3 * 2 * 64
        assert len(adm.stats.by_key) <= 64 + 2
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert adm.num_queued == 0 and adm._queue.num_queues == 0
    asyncio.run(main())


def write(tmp_path, table) -> str:
    path = tmp_path / "limits.json"
    path.write_text(json.dumps(table))
    return str(path)


def test_classes_keys_and_models_from_the_limits_file(tmp_path):
    path = write(tmp_path, {
        "classes": {"gold": {"share": 10}, "silver": {}, "bulk": {"queue_fraction": 0.25}},
        "default_class": "silver",
        "sk-a": {"priority_class": "gold", "share": 3},
        "sk-b": {"priority_class": "bulk", "requests_per_second": 5},
        "models": {"big": {"priority_class": "bulk"}},
    })
    p = load_priorities(path, ("sk-a", "sk-b", "sk-c"))
    assert p.classes.names == ("gold", "silver", "bulk") and p.classes.default_rank == 1
    assert p.ceiling(0, "small") == 0 and p.ceiling(2, "small") == 1
    assert p.ceiling(None, "small") == 1 and p.ceiling(1, "small") == 2
    assert p.ceiling(0, "big") == 2  # the model's class lowers the key's
    assert p.share(0) == 3.0 and p.share(2) == 1.0
    assert p.classes.wire_priority(0) == -1 and p.classes.wire_priority(2) == 1


@pytest.mark.parametrize("table", [
    {"sk-a": {"priority_class": "platinum"}},
    {"classes": {"a": {"share": 0}}},
    {"classes": {"a": {"share": 1, "weight": 2}}},
    {"classes": {"a": {}}, "default_class": "b"},
    {"sk-a": {"share": -1}},
    {"classes": {"a": {"queue_fraction": 1.5}}},
])
def test_bad_priority_settings_fail_at_start(tmp_path, table):
    with pytest.raises(RateLimitConfigError):
        load_priorities(write(tmp_path, table), ("sk-a",))


@pytest.mark.parametrize("asked, ceiling, expected", [
    (None, 0, 0), (None, 1, 1),
    (-5, 1, 1), (-1, 1, 1), ("critical", 1, 1),  # never above the key's class
    (0, 0, 1), (1, 0, 2), (99, 0, 2), ("sheddable", 0, 2), ("standard", 0, 1),
    (-1, 0, 0), ("critical", 0, 0),
])
def test_a_request_may_lower_its_priority_never_raise_it(asked, ceiling, expected):
    assert PriorityClasses().effective_rank(ceiling, asked) == expected


def test_a_class_above_the_default_reaches_a_full_worker_where_it_can_take_a_slot():
    """A full worker (capacity: max_num_seqs + its queue) still takes a critical request, up
    to a batch more, so the worker admits it ahead of the rest; standard ones wait."""
    async def main():
        reg = WorkerRegistry(max_waiting_per_worker=0)
        reg.register(hello("a", max_num_seqs=2), route("a", max_num_seqs=2), 0.0)
        adm = Admission(reg, max_queued=10, timeout_s=5)
        for i in range(2):
            await adm.acquire(f"t{i}", ticket=Ticket(STANDARD, 0))
        waiting = asyncio.create_task(adm.acquire("t2", ticket=Ticket(STANDARD, 0)))
        await settle()
        assert adm.num_queued == 1
        for i in range(2):  # past the queued standard request, at once
            worker = await asyncio.wait_for(adm.acquire(f"c{i}", ticket=Ticket(CRITICAL, 1)),
                                            1)
            assert worker.worker_id == "a"
        late = asyncio.create_task(adm.acquire("c2", ticket=Ticket(CRITICAL, 1)))
        await settle()
        assert not late.done() and adm.num_queued == 2  # a batch more, no further
        reg.release("a", "t0")
        adm.wake()
        await settle()
        assert late.done() and not waiting.done()  # the critical one goes first
        assert Admission(reg, 10, 5, is_fair=False).try_acquire("x", rank=CRITICAL) is None
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
    asyncio.run(main())


def test_refusal_before_body_only_where_the_key_alone_decides_and_admission_would_refuse():
    """Admission.refusal_before_body (gateway/http/early_shed.py asks it before reading a
    body): the lowest class's 429 once its part of the queue is full and no worker has room;
    never for a better class (a body may ask for any class below it, or take a lower one's
    place); under fcfs, any key's once the whole queue is full."""
    async def main() -> None:
        reg = one_slot()
        adm = Admission(reg, max_queued=4, timeout_s=5)
        assert adm.refusal_before_body(SHEDDABLE, 0) is None  # a worker has room
        await adm.acquire("s0", ticket=Ticket(SHEDDABLE, 0))
        tasks = [asyncio.create_task(adm.acquire(f"s{i}", ticket=Ticket(SHEDDABLE, 0)))
                 for i in (1, 2)]
        await settle()
        assert adm.num_queued == 2  # sheddable's half of the queue
        refusal = adm.refusal_before_body(SHEDDABLE, 0)
        assert refusal is not None and refusal.status == 429 and "sheddable" in refusal.message
        assert adm.stats.by_class[SHEDDABLE].num_shed == 1
        assert adm.refusal_before_body(STANDARD, 1) is None
        assert adm.refusal_before_body(CRITICAL, 1) is None
        # What admission does with such requests once their bodies are read: the same.
        with pytest.raises(APIError) as e:
            await adm.acquire("s3", ticket=Ticket(SHEDDABLE, 0))
        assert e.value.status == 429
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

        fcfs = Admission(one_slot(), max_queued=2, timeout_s=5, is_fair=False)
        await fcfs.acquire("a0", ticket=Ticket(STANDARD, 0))
        assert fcfs.refusal_before_body(STANDARD, 0) is None  # room in the queue
        tasks = [asyncio.create_task(fcfs.acquire(f"a{i}", ticket=Ticket(STANDARD, 0)))
                 for i in (1, 2)]
        await settle()
        refusal = fcfs.refusal_before_body(CRITICAL, 1)
        assert refusal is not None and refusal.status == 429
        fcfs.close(APIError(503, "stopping"))
        assert fcfs.refusal_before_body(CRITICAL, 1) is None  # closing: its own error
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def test_requests_still_arriving_count_as_queued_until_admission_takes_them():
    """A burst's requests all pass refusal_before_body before the first is queued: each is
    counted (an Arrival) until admission assigns, queues or refuses it, so the burst's
    requests beyond the class's places are refused before their bodies too."""
    async def main() -> None:
        reg = one_slot()
        adm = Admission(reg, max_queued=4, timeout_s=5)  # sheddable: 2 places
        await adm.acquire("s0", ticket=Ticket(SHEDDABLE, 0))
        burst = []
        for _ in range(3):
            if adm.refusal_before_body(SHEDDABLE, 0) is None:
                burst.append(Arrival(adm))
        assert len(burst) == 2 and adm.num_arriving == 2
        tasks = [asyncio.create_task(adm.acquire(f"s{i}", ticket=Ticket(SHEDDABLE, 0, 1.0, a)))
                 for i, a in enumerate(burst, 1)]
        await settle()
        assert adm.num_queued == 2 and adm.num_arriving == 0
        late = Arrival(adm)  # one that passed before the queue filled: refused at admission
        with pytest.raises(APIError):
            await adm.acquire("s3", ticket=Ticket(SHEDDABLE, 0, 1.0, late))
        assert adm.num_arriving == 0
        late.done()  # counted once
        assert adm.num_arriving == 0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
