"""Admission control: a bounded queue of requests waiting for worker capacity, served by
priority class and fairly across keys (gateway/fair_queue.py).

A request goes straight to a worker when one can take it and nobody is queued ahead for the
same workers. Otherwise it waits here, up to `max_queued` requests and up to `timeout_s`
(then 503). With no live worker, requests wait too, so a worker restart does not fail the
requests that arrive meanwhile. Whoever frees capacity (a request ending, a worker saying
HELLO) calls `wake()`, which hands workers out in the fair queue's order: classes by share,
keys (flows) within a class by weighted fair share, each key's own requests in order. The
worker is reserved for the request before its waiter resumes, so two waiters never count the
same free slot. Each request goes where the registry's router sends its prompt
(gateway/workers/routing.py), among the workers of its target (model, version): a request
whose target's workers are busy does not hold up one for another target.

Shedding, lowest class first: a class may fill its `queue_fraction` of the queue; past it,
or in a full queue, a request takes the place of the newest request of the longest flow of
the least important class below its own, which gets the 429 (with Retry-After) instead; with
no such request, the new one gets the 429. So `critical` is refused last.

`fcfs` (is_fair False): one first-in, first-out queue for all, no shedding by class: the
baseline the fair queue is measured against (benchmarks/bench_fairness.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from zeroserve.gateway.errors import APIError, no_worker, queue_full
from zeroserve.gateway.fair_queue import DEFAULT_MAX_FLOWS, Entry, FairQueue
from zeroserve.gateway.priority_classes import PriorityClasses
from zeroserve.gateway.queue_stats import QueueStats
from zeroserve.gateway.workers.flow_load import Flow
from zeroserve.gateway.workers.handle import WorkerHandle
from zeroserve.gateway.workers.models import Target
from zeroserve.gateway.workers.prefix import Prefix
from zeroserve.gateway.workers.registry import WorkerRegistry


class Arrival:
    """A request that passed Admission.refusal_before_body (gateway/http/early_shed.py),
    counted in its num_arriving until admission assigns, queues or refuses it, or it ends
    before that (a 400, a client gone): `done`, which counts once."""

    __slots__ = ("_admission",)

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission
        admission.num_arriving += 1

    def done(self) -> None:
        if self._admission is not None:
            self._admission.num_arriving -= 1
            self._admission = None


@dataclass(frozen=True)
class Ticket:
    """Where a request queues: its class's rank, its client (an API key's index, or the
    client's address without keys) and the client's weight within the class."""

    rank: int
    client: Hashable = None
    weight: float = 1.0
    # Counted as arriving (Admission.refusal_before_body) until it is assigned or queued.
    arrival: Arrival | None = field(default=None, compare=False, repr=False)


@dataclass
class _Waiter:
    request_id: str
    prefix: Prefix | None
    future: asyncio.Future
    target: Target | None
    flow: Flow | None = None  # its class and client, counted on the worker that takes it


def shed(class_name: str, retry_after_s: int) -> APIError:
    return APIError(429, f"The server is at capacity: requests of priority class "
                         f"'{class_name}' are being shed. Retry later.",
                    type="rate_limit_error", code="queue_full",
                    headers={"Retry-After": str(retry_after_s)})


class Admission:
    def __init__(self, registry: WorkerRegistry, max_queued: int, timeout_s: float,
                 retry_after_s: int = 1, classes: PriorityClasses | None = None,
                 is_fair: bool = True, max_flows: int = DEFAULT_MAX_FLOWS,
                 clock: Callable[[], float] = time.monotonic):
        self.registry = registry
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.classes = classes or PriorityClasses()
        self.is_fair = is_fair
        self.clock = clock
        shares = [c.share for c in self.classes.classes] if is_fair else [1.0]
        self._queue = FairQueue(shares, max_flows)
        self._closed_with: APIError | None = None  # set by close(): later acquires fail
        self._num_waiting_for: Counter[Target | None] = Counter()  # entries in the queue
        self.num_arriving = 0  # Arrivals not done (refusal_before_body counts them)
        self.stats = QueueStats(self.classes.names)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def default_ticket(self) -> Ticket:
        return Ticket(self.classes.default_rank)

    def set_share(self, name: str, share: float) -> bool:
        """A class's share from now on (the admin API); False for an unknown class."""
        rank = self.classes.rank_of(name)
        if rank is None:
            return False
        self.stats.shares[rank] = share
        if self.is_fair:
            self._queue.set_share(rank, share)
        return True

    def shares(self) -> dict[str, float]:
        return dict(zip(self.classes.names, self.stats.current_shares(self.classes),
                        strict=True))

    def check_room(self, num_requests: int = 1, ticket: Ticket | None = None) -> None:
        """Raise 429 now if these many new requests could not all be queued (counting the
        lower classes' requests they could take the places of)."""
        ticket = ticket or self.default_ticket()
        if self.num_queued or self.registry.pick() is None:
            room = self._limit(ticket.rank) - self.num_queued
            if self.is_fair:
                room += sum(self._queue.num_of_rank(r)
                            for r in range(ticket.rank + 1, len(self.classes.classes)))
            if num_requests > room:
                self.stats.on_shed(ticket.rank, ticket.client, num_requests)
                raise self._refusal(ticket.rank)

    def decides_before_body(self, key_rank: int) -> bool:
        """Can a request of this key be refused before its body is read? Only where the key
        alone decides its class: the lowest (a request may lower its class, never raise it,
        so it stays there whatever model or `priority` its body names), or under fcfs (no
        classes). gateway/http/early_shed.py asks, and `refusal_before_body` answers."""
        return not self.is_fair or key_rank == len(self.classes.classes) - 1

    def refusal_before_body(self, key_rank: int, client: Hashable = None) -> APIError | None:
        """For a key that `decides_before_body`: its 429 now, counted as shed, or None. The
        queue is at the class's limit, counting the requests of such keys still arriving
        (past this check and not at admission yet: a burst's requests all pass here before
        the first of them is queued) as queued, with nothing below the class to take the
        place of; and no worker of any model can take a request of the key's flow now (so
        none of the body's target could either)."""
        if self._closed_with is not None:
            return None
        if self.num_queued + self.num_arriving < self._limit(key_rank):
            return None
        if self.registry.pick(None, None, False, self._flow(key_rank, client)) is not None:
            return None
        self.stats.on_shed(key_rank, client)
        return self._refusal(key_rank)

    async def acquire(self, request_id: str, prompt_token_ids: list[int] | None = None,
                      cache_key: str | None = None, target: Target | None = None,
                      ticket: Ticket | None = None) -> WorkerHandle:
        """A worker with the request already assigned to it; 429 or 503 otherwise.
        `prompt_token_ids`: what the router places the request by (None: least loaded);
        `cache_key`: the client's conversation name, which breaks the router's ties;
        `target`: the model (and version) whose workers may take it (None: any);
        `ticket`: its class and client (None: the default class, no client)."""
        ticket = ticket or self.default_ticket()
        try:
            worker = self.try_acquire(request_id, prompt_token_ids, cache_key, target,
                                      ticket.rank, ticket.client)
            if worker is not None:
                return worker
            self._make_room(ticket)
            prefix = None if prompt_token_ids is None else Prefix(prompt_token_ids, cache_key)
            future: asyncio.Future = asyncio.get_running_loop().create_future()
            waiter = _Waiter(request_id, prefix, future, target,
                             self._flow(ticket.rank, ticket.client))
            rank, flow = (ticket.rank, (ticket.client, target)) if self.is_fair else (0, None)
            entry = Entry(waiter, rank, flow, ticket.weight, self.clock())
            self._queue.push(entry)
            self._num_waiting_for[target] += 1
            self.stats.on_queued(ticket.rank, ticket.client)
        finally:
            if ticket.arrival is not None:  # assigned, queued or refused: no longer arriving
                ticket.arrival.done()
        is_handed_over = False
        try:
            worker = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
            is_handed_over = True
            return worker
        except TimeoutError:
            raise no_worker(f"No worker became available within {self.timeout_s:g}s.") from None
        finally:
            if self._queue.remove(entry):
                self._left(target)
            self.stats.on_left(ticket.rank, ticket.client, self.clock() - entry.enqueued_at,
                               is_handed_over)
            if not is_handed_over:
                self._give_back(future, request_id)

    def try_acquire(self, request_id: str, prompt_token_ids: list[int] | None = None,
                    cache_key: str | None = None, target: Target | None = None,
                    rank: int | None = None, client: Hashable = None) -> WorkerHandle | None:
        """`acquire` without waiting: a worker with the request assigned to it, if one of
        `target`'s can take it now and nobody waits ahead for the same workers (of its class
        or a better one, for a class above the default); None otherwise. A request whose
        flow (class and `client`) has nothing queued here and holds 2 requests fewer on a
        worker than its class's flow holding the most there goes to that worker even when
        it is full or others wait (the worker gives it a slot of that flow's at once:
        gateway/workers/flow_load.py). Raises what `close` was given."""
        if self._closed_with is not None:
            raise self._closed_with
        is_priority = rank is not None and self._is_priority(rank)
        flow = None if rank is None else self._flow(rank, client)
        prefix = None if prompt_token_ids is None else Prefix(prompt_token_ids, cache_key)
        if self._is_queued_for(target) and not (
                is_priority and not any(self._queue.num_of_rank(r) for r in range(rank + 1))):
            if flow is None or self._queue.has_flow(rank, (client, target)):
                return None  # behind those waiting (its own first)
            worker = self.registry.pick_for_flow(prefix, target, flow)
        else:
            worker = self.registry.pick(prefix, target, is_priority, flow)
        if worker is not None:
            self.registry.assign(worker, request_id, prefix, flow)
        return worker

    def close(self, error: APIError) -> None:
        """The server is stopping: the waiting requests fail with `error` now (they would
        wait for a worker that no longer comes), and so does every later one."""
        self._closed_with = error
        for entry in self._queue.clear():
            if not entry.payload.future.done():
                entry.payload.future.set_exception(error)
        self._num_waiting_for.clear()

    # --- inside ------------------------------------------------------------------------

    def _flow(self, rank: int, client: Hashable) -> Flow | None:
        """What a worker counts the request's share by (None: fcfs, or no client)."""
        return (rank, client) if self.is_fair and client is not None else None

    def _is_priority(self, rank: int) -> bool:
        """A class above the default one: it may go to a worker past its capacity, up to a
        batch more (WorkerHandle.can_accept_priority), where it takes a lower class's slot."""
        return self.is_fair and rank < self.classes.default_rank

    def _limit(self, rank: int) -> int:
        """How full the queue may be for a request of this class to join it freely."""
        if not self.is_fair:
            return self.max_queued
        fraction = self.classes.classes[rank].queue_fraction
        return min(self.max_queued, max(1, math.floor(self.max_queued * fraction)))

    def _refusal(self, rank: int) -> APIError:
        if not self.is_fair:
            return queue_full(self.retry_after_s)
        return shed(self.classes.classes[rank].name, self.retry_after_s)

    def _make_room(self, ticket: Ticket) -> None:
        """Room for one request of `ticket`'s class: free, or the place of a lower class's
        request (which gets the 429); a 429 for this one otherwise."""
        if self.num_queued < self._limit(ticket.rank):
            return
        victim = self._queue.pop_worst(ticket.rank) if self.is_fair else None
        if victim is None:
            self.stats.on_shed(ticket.rank, ticket.client)
            raise self._refusal(ticket.rank)
        waiter = victim.payload
        self._left(waiter.target)
        if not waiter.future.done():
            waiter.future.set_exception(self._refusal(victim.rank))
        self.stats.on_displaced(victim.rank, victim.flow[0])

    def _give_back(self, future: asyncio.Future, request_id: str) -> None:
        """We stopped waiting (timeout, cancel); if a worker was reserved meanwhile, free it."""
        if not future.done():
            future.cancel()
        elif not future.cancelled() and future.exception() is None:
            self.registry.release(future.result().worker_id, request_id)
            self.wake()

    def _is_queued_for(self, target: Target | None) -> bool:
        """Someone waits for the same workers (they go first)."""
        if target is None:
            return bool(self._num_waiting_for)
        return self._num_waiting_for[target] > 0 or self._num_waiting_for[None] > 0

    def _left(self, target: Target | None) -> None:
        self._num_waiting_for[target] -= 1
        if self._num_waiting_for[target] <= 0:
            del self._num_waiting_for[target]

    def wake(self) -> None:
        """Hand free capacity to waiters in the fair queue's order (a waiter whose target has
        no free worker keeps its place and does not hold up the others)."""
        blocked: set[tuple[Target | None, bool]] = set()  # (target, is_priority)
        picked: list[WorkerHandle] = []  # the worker for the head `is_blocked` let through

        def is_blocked(entry: Entry) -> bool:
            waiter = entry.payload
            if waiter.future.done():
                return False  # gone: taken out below
            key = (waiter.target, self._is_priority(entry.rank))
            if key in blocked:
                return True
            worker = self.registry.pick(waiter.prefix, waiter.target, key[1])
            if worker is None:
                blocked.add(key)
                return True
            picked.append(worker)
            return False

        def is_exhausted() -> bool:
            # Every waiting target blocked, for the priority classes too if any wait.
            num_kinds = 2 if any(self._queue.num_of_rank(r)
                                 for r in range(self.classes.default_rank)) else 1
            return len(blocked) >= num_kinds * len(self._num_waiting_for)

        while self._queue and not is_exhausted():
            picked.clear()
            entry = self._queue.pop(is_blocked, is_exhausted)
            if entry is None:
                return
            waiter = entry.payload
            self._left(waiter.target)
            if waiter.future.done():
                continue
            self.registry.assign(picked[-1], waiter.request_id, waiter.prefix, waiter.flow)
            waiter.future.set_result(picked[-1])
