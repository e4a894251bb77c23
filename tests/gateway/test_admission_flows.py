"""Fair shares of a worker's batch across flows (gateway/workers/flow_load.py, issue 39): a
key with fewer requests on a full worker than the key holding it goes there at once (the
worker gives it a slot of that key's), past the other key's queue; fcfs never does."""

from __future__ import annotations

import asyncio

import pytest

from tests.gateway.test_admission_fairness import STANDARD, settle
from tests.gateway.workers.test_registry import hello, route
from zeroserve.gateway.admission import Admission, Ticket
from zeroserve.gateway.workers.flow_load import FlowLoad, wire_flow
from zeroserve.gateway.workers.registry import WorkerRegistry

pytestmark = pytest.mark.timeout(60)
A, B = 0, 1  # two API keys' indexes


def full_worker(is_fair: bool):
    """A worker of 4 slots held by key A, with 3 more of A's requests queued here."""
    reg = WorkerRegistry(max_waiting_per_worker=0)
    reg.register(hello("w", max_num_seqs=4), route("w", max_num_seqs=4), 0.0)
    adm = Admission(reg, max_queued=100, timeout_s=5, is_fair=is_fair)
    return reg, adm


def test_a_key_behind_on_a_full_worker_goes_there_at_once_past_the_queue():
    async def main(is_fair: bool):
        reg, adm = full_worker(is_fair)
        for i in range(4):
            await adm.acquire(f"a{i}", ticket=Ticket(STANDARD, A))
        queued = [asyncio.create_task(adm.acquire(f"a{i}", ticket=Ticket(STANDARD, A)))
                  for i in range(4, 7)]
        await settle()
        assert adm.num_queued == 3
        started = []
        for i in range(4):
            task = asyncio.create_task(adm.acquire(f"b{i}", ticket=Ticket(STANDARD, B)))
            await settle()
            if task.done():
                started.append(task.result().worker_id)
        for task in queued:
            task.cancel()
        await asyncio.gather(*queued, return_exceptions=True)
        return started, adm.num_queued

    # B goes to the full worker while it holds 2 fewer than A there: 0, 1 and 2 of A's 4.
    assert asyncio.run(main(True)) == (["w", "w", "w"], 1)
    assert asyncio.run(main(False)) == ([], 4)  # fcfs: behind A's queue, every one


def test_flow_counts_follow_assign_and_release_and_stay_bounded():
    reg, _ = full_worker(True)
    worker = reg.get("w")
    for i in range(3):
        reg.assign(worker, f"a{i}", flow=(STANDARD, A))
    reg.assign(worker, "b0", flow=(STANDARD, B))
    assert worker.can_accept_flow((STANDARD, B)) and not worker.can_accept_flow((STANDARD, A))
    assert not worker.can_accept_flow((STANDARD + 1, B))  # another class: nobody ahead
    for i in range(3):
        reg.release("w", f"a{i}")
    reg.release("w", "b0")
    assert worker.flows.count((STANDARD, A)) == 0 and not worker.flows._counts
    loads = FlowLoad()
    loads.discard("never-added")  # harmless


def test_wire_flow_names_a_client_alike_everywhere_and_never_0():
    assert wire_flow(None) == 0
    assert wire_flow(3) == wire_flow(3) != wire_flow(4)
    assert wire_flow(("ip", "10.0.0.1")) != wire_flow(("ip", "10.0.0.2"))
    assert all(1 <= wire_flow(i) < 2 ** 32 for i in range(1000))
