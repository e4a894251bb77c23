"""Admission control: a bounded FIFO of requests waiting for worker capacity.

A request goes straight to a worker when one can take it and nobody is queued ahead.
Otherwise it waits here, up to `max_queued` requests (beyond that: 429 with Retry-After)
and up to `timeout_s` (then 503). With no live worker, requests wait too, so a worker
restart does not fail the requests that arrive meanwhile. Whoever frees capacity (a
request ending, a worker saying HELLO) calls `wake()`, which hands workers out in order.
The worker is reserved for the request before its waiter resumes, so two waiters never
count the same free slot. Each request goes where the registry's router sends its prompt
(gateway/workers/routing.py), among the workers of its target (model, version): the queue
is first-in first-out per target, and a request for a model whose workers are busy does
not hold up one for another model.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque

from zeroserve.gateway.errors import APIError, no_worker, queue_full
from zeroserve.gateway.workers.handle import WorkerHandle
from zeroserve.gateway.workers.models import Target
from zeroserve.gateway.workers.prefix import Prefix
from zeroserve.gateway.workers.registry import WorkerRegistry


class Admission:
    def __init__(self, registry: WorkerRegistry, max_queued: int, timeout_s: float,
                 retry_after_s: int = 1):
        self.registry = registry
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._waiters: deque[tuple[str, Prefix | None, asyncio.Future, Target | None]] = deque()
        self._closed_with: APIError | None = None  # set by close(): later acquires fail
        self._num_waiting_for: Counter[Target | None] = Counter()  # entries in _waiters

    @property
    def num_queued(self) -> int:
        return sum(1 for _, _, f, _ in self._waiters if not f.done())

    def check_room(self, num_requests: int = 1) -> None:
        """Raise 429 now if these many new requests could not all be queued."""
        if self._waiters or self.registry.pick() is None:
            if self.num_queued + num_requests > self.max_queued:
                raise queue_full(self.retry_after_s)

    async def acquire(self, request_id: str, prompt_token_ids: list[int] | None = None,
                      cache_key: str | None = None, target: Target | None = None
                      ) -> WorkerHandle:
        """A worker with the request already assigned to it; 429 or 503 otherwise.
        `prompt_token_ids`: what the router places the request by (None: least loaded);
        `cache_key`: the client's conversation name, which breaks the router's ties;
        `target`: the model (and version) whose workers may take it (None: any)."""
        worker = self.try_acquire(request_id, prompt_token_ids, cache_key, target)
        if worker is not None:
            return worker
        prefix = None if prompt_token_ids is None else Prefix(prompt_token_ids, cache_key)
        if self.num_queued >= self.max_queued:
            raise queue_full(self.retry_after_s)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        entry = (request_id, prefix, future, target)
        self._waiters.append(entry)
        self._num_waiting_for[target] += 1
        is_handed_over = False
        try:
            worker = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
            is_handed_over = True
            return worker
        except TimeoutError:
            raise no_worker(f"No worker became available within {self.timeout_s:g}s.") from None
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)
                self._left(target)
            if not is_handed_over:
                self._give_back(future, request_id)

    def try_acquire(self, request_id: str, prompt_token_ids: list[int] | None = None,
                    cache_key: str | None = None, target: Target | None = None
                    ) -> WorkerHandle | None:
        """`acquire` without waiting: a worker with the request assigned to it, if one of
        `target`'s can take it now and nobody waits ahead for the same workers (first come,
        first served); None otherwise. Raises what `close` was given."""
        if self._closed_with is not None:
            raise self._closed_with
        if self._is_queued_for(target):
            return None
        prefix = None if prompt_token_ids is None else Prefix(prompt_token_ids, cache_key)
        worker = self.registry.pick(prefix, target)
        if worker is not None:
            self.registry.assign(worker, request_id, prefix)
        return worker

    def close(self, error: APIError) -> None:
        """The server is stopping: the waiting requests fail with `error` now (they would
        wait for a worker that no longer comes), and so does every later one."""
        self._closed_with = error
        while self._waiters:
            _, _, future, _ = self._waiters.popleft()
            if not future.done():
                future.set_exception(error)
        self._num_waiting_for.clear()

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
            return bool(self._waiters)
        return self._num_waiting_for[target] > 0 or self._num_waiting_for[None] > 0

    def _left(self, target: Target | None) -> None:
        self._num_waiting_for[target] -= 1
        if self._num_waiting_for[target] <= 0:
            del self._num_waiting_for[target]

    def wake(self) -> None:
        """Hand free capacity to waiters, oldest first (per target: a waiter whose target
        has no free worker does not hold up the ones behind it for other targets; with one
        target this stops at the first that cannot be served, as a plain FIFO)."""
        blocked: set[Target | None] = set()
        index = 0
        while index < len(self._waiters) and len(blocked) < len(self._num_waiting_for):
            request_id, prefix, future, target = self._waiters[index]
            if future.done():
                del self._waiters[index]
                self._left(target)
                continue
            if target in blocked:
                index += 1
                continue
            worker = self.registry.pick(prefix, target)
            if worker is None:
                blocked.add(target)
                index += 1
                continue
            del self._waiters[index]
            self._left(target)
            self.registry.assign(worker, request_id, prefix)
            future.set_result(worker)

