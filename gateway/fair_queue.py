"""The gateway's queue of waiting requests: priority classes, fair queuing across flows.

Two levels of start-time fair queuing (SFQ, the virtual-clock scheduler of network links and
of the Kubernetes API server's Priority and Fairness), one request costing one unit:

- **Classes** (gateway/priority_classes.py) with requests waiting are served in proportion to
  their shares: each backlogged class has a virtual start tag, the smallest goes next (ties:
  the more important class), and its tag then moves on by 1 / share.
- **Flows** within a class (a flow: an API key, or a client address without keys, with its
  target) are served in proportion to their weights (the key's `share`, 1 by default) the same
  way, each flow's requests first in, first out. A flow that was idle starts at the class's
  virtual time, so a key's burst waits behind its own earlier requests, never in front of
  another key's next one, and a light flow's request goes out at the next free slot.

Bounded bookkeeping: a flow has a queue only while it has requests waiting, and a class holds
at most `max_flows` queues of their own; beyond that, new flows share one of `max_flows`
hashed queues (a stochastic fair queue). So under any flood of distinct keys a class holds at
most 2 x max_flows queues, the entries are bounded by the gateway's queue limit, and the
per-flow statistics (gateway/observability/fairness_metrics.py) keep only their labelled
flows. Choosing the next request is O(log queues) (a heap per class with lazy deletion).

Plain data: no asyncio, no I/O. `Entry.payload` is the caller's (gateway/admission.py).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import Any

DEFAULT_MAX_FLOWS = 1024


class Entry:
    """One waiting request: where it waits and what it costs."""

    __slots__ = ("payload", "rank", "flow", "weight", "queue", "enqueued_at")

    def __init__(self, payload: Any, rank: int, flow: Hashable, weight: float,
                 enqueued_at: float) -> None:
        self.payload = payload
        self.rank = rank
        self.flow = flow
        self.weight = weight
        self.queue: _FlowQueue | None = None
        self.enqueued_at = enqueued_at


class _FlowQueue:
    __slots__ = ("key", "entries", "start", "token")

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.entries: deque[Entry] = deque()
        self.start = 0.0  # virtual start tag of its head
        self.token = 0  # the heap item that is current for it (lazy deletion)


class _Class:
    """One priority class: its flows' queues, its virtual clock and its own tags."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.queues: dict[Hashable, _FlowQueue] = {}  # only queues with entries
        self.heap: list[tuple[float, int, _FlowQueue]] = []  # (start, token, queue)
        self.vtime = 0.0  # the start tag of the flow served last
        self.start = 0.0  # this class's own start tag among the classes
        self.num_entries = 0


class FairQueue:
    """Waiting requests by class and flow; `pop` gives the next one to serve."""

    def __init__(self, shares: list[float], max_flows: int = DEFAULT_MAX_FLOWS,
                 seed: int | None = None) -> None:
        self._classes = [_Class(share) for share in shares]
        self.max_flows = max_flows
        self._vtime = 0.0  # among classes
        self._tokens = itertools.count(1)
        # Hashed queues' names are salted per process, so no client can aim at another's.
        self._salt = random.Random(seed).getrandbits(64)

    # --- reading -----------------------------------------------------------------------

    def __len__(self) -> int:
        return sum(c.num_entries for c in self._classes)

    def num_of_rank(self, rank: int) -> int:
        return self._classes[rank].num_entries

    @property
    def num_queues(self) -> int:
        """Queues held now, in all classes (the bookkeeping's size)."""
        return sum(len(c.queues) for c in self._classes)

    def has_flow(self, rank: int, flow: Hashable) -> bool:
        """Does `flow` have requests waiting in class `rank` (in a queue of its own)?"""
        return flow in self._classes[rank].queues

    def shares(self) -> list[float]:
        return [c.share for c in self._classes]

    def set_share(self, rank: int, share: float) -> None:
        self._classes[rank].share = share

    def entries(self) -> Iterator[Entry]:
        for c in self._classes:
            for queue in c.queues.values():
                yield from queue.entries

    # --- changing ----------------------------------------------------------------------

    def push(self, entry: Entry) -> None:
        c = self._classes[entry.rank]
        queue = c.queues.get(entry.flow)
        if queue is None:
            key = entry.flow
            if len(c.queues) >= self.max_flows:  # a stochastic fair queue from here on
                key = ("shared", hash((self._salt, entry.flow)) % self.max_flows)
                queue = c.queues.get(key)
            if queue is None:
                if len(c.heap) > 2 * len(c.queues) + 64:  # stale items of emptied queues
                    c.heap = [(q.start, q.token, q) for q in c.queues.values()]
                    heapq.heapify(c.heap)
                queue = c.queues[key] = _FlowQueue(key)
                queue.start = c.vtime
                self._schedule(c, queue)
        if not c.num_entries:  # the class becomes backlogged
            c.start = max(c.start, self._vtime)
        queue.entries.append(entry)
        entry.queue = queue
        c.num_entries += 1

    def remove(self, entry: Entry) -> bool:
        """Take a waiting entry out (its request gave up); False if it is not waiting."""
        queue = entry.queue
        if queue is None:
            return False
        try:
            queue.entries.remove(entry)
        except ValueError:
            return False
        entry.queue = None
        c = self._classes[entry.rank]
        c.num_entries -= 1
        if not queue.entries:
            del c.queues[queue.key]  # its heap item goes stale
        return True

    def pop(self, is_blocked: Callable[[Entry], bool] = lambda entry: False,
            is_exhausted: Callable[[], bool] = lambda: False) -> Entry | None:
        """The next entry to serve, taken out: the class with the smallest tag, within it
        the flow with the smallest tag; heads that `is_blocked` refuses (their workers are
        busy) are passed over and keep their places. None when nothing can be served, or
        once `is_exhausted()` says nothing more can (checked after each head passed over)."""
        order = sorted((c.start, rank) for rank, c in enumerate(self._classes)
                       if c.num_entries)
        for _, rank in order:
            if is_exhausted():
                return None
            entry = self._pop_from(self._classes[rank], is_blocked, is_exhausted)
            if entry is not None:
                c = self._classes[rank]
                self._vtime = c.start
                c.start += 1.0 / c.share
                return entry
        return None

    def pop_worst(self, better_than: int) -> Entry | None:
        """For a request of class `better_than` in a full queue: the newest entry of the
        longest flow of the least important class below it, taken out; None if none."""
        for rank in range(len(self._classes) - 1, better_than, -1):
            c = self._classes[rank]
            if c.num_entries:
                queue = max(c.queues.values(), key=lambda q: len(q.entries))
                entry = queue.entries[-1]
                self.remove(entry)
                return entry
        return None

    def clear(self) -> list[Entry]:
        taken = list(self.entries())
        for c in self._classes:
            c.queues.clear()
            c.heap.clear()
            c.num_entries = 0
        for entry in taken:
            entry.queue = None
        return taken

    # --- inside a class ----------------------------------------------------------------

    def _schedule(self, c: _Class, queue: _FlowQueue) -> None:
        queue.token = next(self._tokens)
        heapq.heappush(c.heap, (queue.start, queue.token, queue))

    def _pop_from(self, c: _Class, is_blocked: Callable[[Entry], bool],
                  is_exhausted: Callable[[], bool]) -> Entry | None:
        passed: list[tuple[float, int, _FlowQueue]] = []
        found = None
        while c.heap:
            item = heapq.heappop(c.heap)
            _, token, queue = item
            if token != queue.token or c.queues.get(queue.key) is not queue:
                continue  # stale: the queue emptied (or was rescheduled) since
            head = queue.entries[0]
            if is_blocked(head):
                passed.append(item)
                if is_exhausted():
                    break
                continue
            found = head
            queue.entries.popleft()
            head.queue = None
            c.num_entries -= 1
            c.vtime = queue.start
            if queue.entries:
                queue.start += 1.0 / head.weight  # its share of the class's service
                self._schedule(c, queue)
            else:
                del c.queues[queue.key]
            break
        for item in passed:
            heapq.heappush(c.heap, item)
        return found
