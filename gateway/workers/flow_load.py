"""The requests this gateway has in flight on one worker, counted by flow (issue 39).

A flow is a request's priority class's rank and its client (an API key's index, or the
client's address without keys), as its Ticket names them (gateway/admission.py). The worker
shares a full batch's slots fairly across the flows of one priority: a flow holding at least
MIN_LEAD slots fewer than the one holding the most takes a slot from that one
(worker/priority_policy.py). So such a request need not wait in the gateway for a worker with
room: it may go to a full worker, up to a batch more (WorkerHandle.can_accept_flow), which
starts it at once. Which client it serves reaches the worker as SUBMIT.flow: `wire_flow`.

Bounded: a flow is counted only while it has requests in flight on the worker.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable

from zeroserve.common.protocol import MAX_FLOW

# As the worker's MIN_SLOT_LEAD: a flow this many requests behind the one with the most may
# go to a full worker.
MIN_LEAD = 2

Flow = tuple[int, Hashable]  # (class rank, client)


def wire_flow(client: Hashable) -> int:
    """SUBMIT.flow of a client: a 32-bit hash in [1, 2^32), alike in every gateway process
    (so two gateways' requests of one key count as one flow on a worker); 0 means none."""
    if client is None:
        return 0
    digest = hashlib.blake2b(repr(client).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") % MAX_FLOW + 1


class FlowLoad:
    """flow -> requests in flight on one worker, and each request's flow."""

    __slots__ = ("_flow_of", "_counts")

    def __init__(self) -> None:
        self._flow_of: dict[str, Flow] = {}
        self._counts: dict[Flow, int] = {}

    def add(self, request_id: str, flow: Flow) -> None:
        self._flow_of[request_id] = flow
        self._counts[flow] = self._counts.get(flow, 0) + 1

    def discard(self, request_id: str) -> None:
        flow = self._flow_of.pop(request_id, None)
        if flow is None:
            return
        if self._counts[flow] > 1:
            self._counts[flow] -= 1
        else:
            del self._counts[flow]

    def count(self, flow: Flow) -> int:
        return self._counts.get(flow, 0)

    def is_behind(self, flow: Flow) -> bool:
        """Does the flow of this class holding the most hold MIN_LEAD more than `flow`?"""
        rank = flow[0]
        most = max((n for (r, _), n in self._counts.items() if r == rank), default=0)
        return most - self._counts.get(flow, 0) >= MIN_LEAD
