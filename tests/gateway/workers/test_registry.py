"""Worker registry (liveness, draining, routing) and admission (queue, 429, 503)."""

from __future__ import annotations

import asyncio

import pytest

from zeroserve.common.protocol import PROTOCOL_VERSION, Heartbeat, Hello
from zeroserve.gateway.admission import Admission
from zeroserve.gateway.errors import APIError
from zeroserve.gateway.workers.handle import WorkerStatus
from zeroserve.gateway.workers.registry import WorkerRegistry


def hello(worker_id: str, max_num_seqs: int = 4, pid: int = 1) -> Hello:
    return Hello(PROTOCOL_VERSION, worker_id, "m", 2048, 100, 16, max_num_seqs, "cpu", pid)


def route(worker_id: str, max_num_seqs: int = 4, pid: int = 1) -> bytes:
    """Each worker process has its own route (here: one per pid)."""
    return f"{worker_id}.{pid}".encode()


def beat(worker_id: str, running: int = 0, waiting: int = 0, free: int = 100,
         state: str = "ready") -> Heartbeat:
    return Heartbeat(worker_id, state, running, waiting, 0, free, 100, 0.0)


def test_routes_to_least_loaded_worker():
    reg = WorkerRegistry()
    reg.register(hello("a"), route("a"), 0.0)
    reg.register(hello("b"), route("b"), 0.0)
    reg.on_heartbeat(beat("a", running=3), 0.1)
    reg.on_heartbeat(beat("b", running=1), 0.1)
    assert reg.pick().worker_id == "b"
    # Requests sent since the last heartbeat count as load.
    reg.assign(reg.get("b"), "r1")
    reg.assign(reg.get("b"), "r2")
    reg.assign(reg.get("b"), "r3")
    assert reg.pick().worker_id == "a"


def test_ties_break_on_free_kv_blocks():
    reg = WorkerRegistry()
    reg.register(hello("a"), route("a"), 0.0)
    reg.register(hello("b"), route("b"), 0.0)
    reg.on_heartbeat(beat("a", running=2, free=10), 0.1)
    reg.on_heartbeat(beat("b", running=2, free=90), 0.1)
    assert reg.pick().worker_id == "b"


def test_draining_and_full_workers_get_nothing():
    reg = WorkerRegistry(max_waiting_per_worker=0)
    reg.register(hello("a", max_num_seqs=1), route("a", max_num_seqs=1), 0.0)
    reg.register(hello("b", max_num_seqs=1), route("b", max_num_seqs=1), 0.0)
    reg.mark_draining("a")
    assert reg.pick().worker_id == "b"
    reg.assign(reg.get("b"), "r1")
    assert reg.pick() is None  # b is at capacity, a drains
    reg.release("b", "r1")
    assert reg.pick().worker_id == "b"
    reg.on_heartbeat(beat("b", state="draining"), 1.0)
    assert reg.get("b").status is WorkerStatus.DRAINING
    assert reg.pick() is None and not reg.has_ready


def test_an_operators_drain_holds_until_the_worker_says_so_then_the_worker_decides():
    """Two gateways (`serve --gateways 2`) see one worker. Drained through gateway A, it
    stays drained there though a heartbeat sent before the DRAIN says "ready"; undrained
    through gateway B, the worker's "ready" heartbeats end the drain in A as well."""
    reg_a = WorkerRegistry()
    reg_a.register(hello("w"), route("w"), 0.0)
    worker = reg_a.get("w")
    worker.is_drain_requested, worker.status = True, WorkerStatus.DRAINING  # drain_worker
    reg_a.on_heartbeat(beat("w"), 0.1)  # sent before the worker read the DRAIN
    assert worker.status is WorkerStatus.DRAINING and reg_a.pick() is None
    reg_a.on_heartbeat(beat("w", state="draining"), 0.6)
    assert worker.status is WorkerStatus.DRAINING and not worker.is_drain_requested
    reg_a.on_heartbeat(beat("w"), 1.1)  # undrained (through gateway B): it says "ready"
    assert worker.status is WorkerStatus.READY and reg_a.pick() is worker


def test_a_worker_full_of_another_gateways_streams_takes_nothing_more_here():
    """Behind several gateways (`serve --gateways N`) a worker's heartbeats list only this
    gateway's requests but count all of them: the rest fill its capacity too."""
    reg = WorkerRegistry(max_waiting_per_worker=0)
    reg.register(hello("a", max_num_seqs=2), route("a"), 0.0)
    reg.assign(reg.get("a"), "mine")
    reg.on_heartbeat(Heartbeat("a", "ready", 1, 0, 0, 100, 100, 0.0, request_ids=["mine"]), 0.1)
    assert reg.pick().worker_id == "a"  # one of two slots is free
    reg.on_heartbeat(Heartbeat("a", "ready", 2, 0, 0, 100, 100, 0.0, request_ids=["mine"]), 0.2)
    assert reg.get("a").num_foreign == 1 and reg.pick() is None


def test_silent_worker_expires_and_rehello_replaces_it():
    reg = WorkerRegistry()
    reg.register(hello("a", pid=1), route("a", pid=1), 0.0)
    reg.register(hello("b"), route("b"), 0.0)
    reg.on_heartbeat(beat("b"), 2.5)
    lost = reg.expire(now=3.5, timeout_s=3.0)
    assert [w.worker_id for w in lost] == ["a"]
    assert list(reg.workers) == ["b"]
    reg.assign(reg.get("b"), "r1")
    old = reg.register(hello("b", pid=2), route("b", pid=2), 4.0)
    assert old is not None and old.request_ids == {"r1"}
    assert reg.get("b").hello.pid == 2 and not reg.get("b").request_ids


def test_repeated_hello_from_the_same_process_is_not_a_restart():
    reg = WorkerRegistry()
    reg.register(hello("a", pid=7), route("a", pid=7), 0.0)
    reg.assign(reg.get("a"), "r1")
    reg.mark_draining("a")
    assert reg.register(hello("a", pid=7), route("a", pid=7), 1.0) is None
    worker = reg.get("a")
    assert worker.request_ids == {"r1"} and worker.last_seen == 1.0
    assert worker.status is WorkerStatus.READY
    # A new process with the same id (and, in a container, the same pid 1): a new route.
    replaced = reg.register(hello("a", pid=7), b"a.other-process", 2.0)
    assert replaced is not None and replaced.request_ids == {"r1"}


def test_max_model_len_is_the_smallest_live_one():
    reg = WorkerRegistry()
    assert reg.max_model_len() is None
    reg.register(Hello(PROTOCOL_VERSION, "a", "m", 4096, 1, 16, 1, "cpu", 1), b"a.1", 0.0)
    reg.register(Hello(PROTOCOL_VERSION, "b", "m", 1024, 1, 16, 1, "cpu", 1), b"b.1", 0.0)
    assert reg.max_model_len() == 1024


def run(coro):
    return asyncio.run(coro)


def test_admission_queues_until_a_worker_appears():
    async def main():
        reg = WorkerRegistry()
        adm = Admission(reg, max_queued=2, timeout_s=5)
        waiter = asyncio.create_task(adm.acquire("r1"))
        await asyncio.sleep(0.01)
        assert adm.num_queued == 1 and not waiter.done()
        reg.register(hello("a"), route("a"), 0.0)
        adm.wake()
        worker = await waiter
        assert worker.worker_id == "a" and reg.get("a").request_ids == {"r1"}
        assert adm.num_queued == 0
    run(main())


def test_admission_rejects_beyond_the_queue_with_429():
    async def main():
        reg = WorkerRegistry()
        adm = Admission(reg, max_queued=2, timeout_s=5)
        waiters = [asyncio.create_task(adm.acquire(f"r{i}")) for i in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(APIError) as e:
            await adm.acquire("r3")
        assert e.value.status == 429 and e.value.headers["Retry-After"]
        with pytest.raises(APIError):
            adm.check_room(1)
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert adm.num_queued == 0
        adm.check_room(2)  # room again
    run(main())


def test_admission_times_out_with_503():
    async def main():
        adm = Admission(WorkerRegistry(), max_queued=2, timeout_s=0.05)
        with pytest.raises(APIError) as e:
            await adm.acquire("r1")
        assert e.value.status == 503 and adm.num_queued == 0
    run(main())


def test_admission_is_fifo_and_never_overbooks():
    async def main():
        reg = WorkerRegistry(max_waiting_per_worker=0)
        reg.register(hello("a", max_num_seqs=1), route("a", max_num_seqs=1), 0.0)
        adm = Admission(reg, max_queued=10, timeout_s=5)
        first = await adm.acquire("r0")  # takes the only slot
        order = []

        async def wait(rid):
            await adm.acquire(rid)
            order.append(rid)

        tasks = [asyncio.create_task(wait(f"r{i}")) for i in range(1, 4)]
        await asyncio.sleep(0.01)
        assert order == [] and adm.num_queued == 3
        for rid in ["r0", "r1", "r2"]:
            reg.release(first.worker_id, rid)
            adm.wake()
            await asyncio.sleep(0.01)
            assert len(reg.get("a").request_ids) == 1  # one slot, never two
        assert order == ["r1", "r2", "r3"]
        await asyncio.gather(*tasks)
    run(main())


def test_cancelled_waiter_leaves_the_queue():
    async def main():
        reg = WorkerRegistry(max_waiting_per_worker=0)
        adm = Admission(reg, max_queued=10, timeout_s=5)
        t1 = asyncio.create_task(adm.acquire("r1"))
        t2 = asyncio.create_task(adm.acquire("r2"))
        await asyncio.sleep(0.01)
        t1.cancel()  # its client left while queued
        await asyncio.gather(t1, return_exceptions=True)
        assert adm.num_queued == 1
        reg.register(hello("a", max_num_seqs=1), route("a", max_num_seqs=1), 0.0)
        adm.wake()
        worker = await asyncio.wait_for(t2, 1)
        assert worker.worker_id == "a" and reg.get("a").request_ids == {"r2"}
    run(main())


def test_try_acquire_takes_a_free_worker_at_once_but_never_jumps_the_queue():
    """The request path's fast admission (no task, no wait) keeps first come, first served:
    while anyone waits, a new request queues behind them even if a slot is free."""
    async def main():
        reg = WorkerRegistry(max_waiting_per_worker=0)
        adm = Admission(reg, max_queued=10, timeout_s=5)
        assert adm.try_acquire("r0") is None  # no worker: the caller must wait
        reg.register(hello("a", max_num_seqs=1), route("a", max_num_seqs=1), 0.0)
        assert adm.try_acquire("r1").worker_id == "a"
        assert reg.get("a").request_ids == {"r1"}
        assert adm.try_acquire("r2") is None  # full
        waiter = asyncio.create_task(adm.acquire("r2"))
        await asyncio.sleep(0.01)
        reg.release("a", "r1")  # a slot frees up, but r2 waits ahead of r3
        assert adm.try_acquire("r3") is None
        adm.wake()
        assert (await asyncio.wait_for(waiter, 1)).worker_id == "a"
        assert reg.get("a").request_ids == {"r2"}
        adm.close(APIError(503, "shutting down"))
        with pytest.raises(APIError):
            adm.try_acquire("r4")
    run(main())


def make_outbox(worker_ids: list[str]):
    """An outbox that logs what it sends, and one running request per worker id given."""
    from zeroserve.gateway.streams import RequestPhase, RequestState, WorkerOutbox

    sent = []
    outbox = WorkerOutbox(lambda w, g: sent.append(("credit", w, g)),
                          lambda w, r, a: sent.append(("abort", w, r, a)))
    states = [RequestState(f"r{i}", 0, [1], asyncio.Queue(), RequestPhase.RUNNING, worker_id=w,
                           credit_window=8, num_submits=1)
              for i, w in enumerate(worker_ids)]
    return outbox, sent, states


def test_outbox_batches_per_worker_and_drops_credit_for_aborted():
    from zeroserve.gateway.streams import RequestState

    async def main():
        outbox, sent, states = make_outbox(["a", "a", "b"])
        outbox.grant(states[0], 3)
        outbox.grant(states[0], 2)
        outbox.grant(states[1], 1)
        outbox.grant(states[2], 4)
        outbox.abort("a", "r1", 1)
        assert sent == []  # nothing until the loop turns
        await asyncio.sleep(0)
        # Grants are cumulative limits: tokens credited so far + the window (8).
        assert sorted(sent) == [("abort", "a", ["r1"], [1]), ("credit", "a", [["r0", 13, 1]]),
                                ("credit", "b", [["r2", 12, 1]])]
        assert states[0].num_credited == 5
        queued = RequestState("r9", 0, [1], asyncio.Queue())  # not at a worker: no credit
        outbox.grant(queued, 3)
        await asyncio.sleep(0)
        assert len(sent) == 3 and queued.num_credited == 0
    run(main())


def test_credit_goes_back_in_half_window_steps_and_a_resend_gives_back_all():
    async def main():
        outbox, sent, (state,) = make_outbox(["a"])  # window 8: steps of 4
        for _ in range(3):
            outbox.grant(state, 1)
        outbox.flush()
        assert sent == [] and state.num_delivered == 3 and state.credit_limit == 8
        outbox.grant(state, 1)
        outbox.flush()
        assert sent == [("credit", "a", [["r0", 12, 1]])]
        outbox.grant(state, 2)  # below a step: held back
        outbox.resend(state)  # an idle stream's credit, re-sent: everything delivered
        outbox.flush()
        assert sent[1:] == [("credit", "a", [["r0", 14, 1]])]
        assert state.num_undelivered == state.num_received - 6
    run(main())


class ManualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose timers follow a clock the test moves, not the wall clock: a test
    process preempted for a few milliseconds on a loaded machine must not fire a 2 ms timer
    between the loop iterations the test means to fall within it (it did, 1 run in 3,000
    beside three busy loops). Only for coroutines that never wait on a timer themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def time(self) -> float:
        return self.now

    async def advance(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)  # the timers now due run in this iteration ...
        await asyncio.sleep(0)  # ... after the callback that resumes us


def test_outbox_gathers_grants_over_a_short_window_into_one_credit():
    from zeroserve.gateway.streams import CREDIT_DELAY_S

    async def main(loop: ManualClockLoop):
        outbox, sent, states = make_outbox(["a", "a", "a"])
        for state in states:  # handlers granting over several loop iterations
            outbox.grant(state, 4)  # a credit step: half the window of 8
            await asyncio.sleep(0)
        assert sent == []
        await loop.advance(CREDIT_DELAY_S * 0.9)
        assert sent == []  # not before the window ends
        await loop.advance(CREDIT_DELAY_S * 0.2)
        assert sent == [("credit", "a", [["r0", 12, 1], ["r1", 12, 1], ["r2", 12, 1]])]
        # An abort does not wait: it leaves on the next iteration with the pending grants.
        outbox.grant(states[0], 5)
        outbox.abort("a", "r2", 1)
        await asyncio.sleep(0)
        assert sent[1:] == [("credit", "a", [["r0", 17, 1]]), ("abort", "a", ["r2"], [1])]
        await loop.advance(CREDIT_DELAY_S * 5)
        assert len(sent) == 3  # nothing left behind to send twice

    loop = ManualClockLoop()
    try:
        loop.run_until_complete(main(loop))
    finally:
        loop.close()
