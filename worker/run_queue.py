"""The scheduler's running sequences: admission order, O(1) joins and leaves, and the counts
per priority and per flow that worker/priority_policy.py reads. Plain Python, no torch."""

from __future__ import annotations

from collections.abc import Iterator

from zeroserve.worker.sequence import Sequence


class RunQueue:
    """The running sequences in admission order (oldest first), with O(1) append and remove:
    pauses, finishes and aborts of any of 1,000 streams must not scan the others."""

    __slots__ = ("_seqs", "version", "joined", "priorities", "flows")

    def __init__(self) -> None:
        self._seqs: dict[str, Sequence] = {}  # request id -> sequence; dicts keep the order
        self.version = 0  # changes whenever a sequence joins or leaves
        self.joined: list[Sequence] = []  # appended since the scheduler last cleared it
        self.priorities: dict[int, int] = {}  # priority -> running sequences of it (> 0)
        self.flows: dict[tuple[int, int], int] = {}  # (priority, flow) -> the same (> 0)

    def append(self, seq: Sequence) -> None:
        self._seqs[seq.request_id] = seq
        self.version += 1
        self.joined.append(seq)
        self.priorities[seq.priority] = self.priorities.get(seq.priority, 0) + 1
        flow = (seq.priority, seq.flow)
        self.flows[flow] = self.flows.get(flow, 0) + 1

    def remove(self, seq: Sequence) -> None:
        del self._seqs[seq.request_id]
        self.version += 1
        if self.priorities[seq.priority] > 1:
            self.priorities[seq.priority] -= 1
        else:
            del self.priorities[seq.priority]
        flow = (seq.priority, seq.flow)
        if self.flows[flow] > 1:
            self.flows[flow] -= 1
        else:
            del self.flows[flow]

    def __len__(self) -> int:
        return len(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs.values())

    def __reversed__(self) -> Iterator[Sequence]:
        return reversed(self._seqs.values())
