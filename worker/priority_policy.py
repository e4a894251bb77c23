"""The worker's priority policy: where a sequence waits, and who is preempted (vLLM's
`--scheduling-policy priority`, with FCFS as the case where every priority is equal).

A sequence's `priority` comes from its SUBMIT (common/protocol.py): lower is served first,
0 by default; the gateway sends its class's rank relative to the default class, so
`critical` is -1, `standard` 0 and `sheddable` 1 with the default classes.

- The waiting queue is kept in (priority, arrival) order: a new sequence goes behind every
  one of its own priority or better, ahead of any worse; a preempted or resumed one goes to
  the front of its own priority (it was admitted before the others of its priority waiting).
  With every priority equal this is the plain FIFO: append, and appendleft to requeue.
- With the batch full (max_num_seqs), a waiting sequence of a better priority than the worst
  running one takes that one's slot: it is preempted (recompute) and the better one is
  admitted at the next step. Equal priorities never preempt each other for a slot.
- Under KV pressure the victim is the worst priority holding blocks; among equals a paused
  sequence (idle without credit) before a running one, and the newest first. So a lower class
  is always preempted before a higher one, and the order within one priority is the old one.

Plain Python, no torch. Invariant: the queue stays sorted by priority (stable), so admission
(the scheduler takes waiting[0], waiting[1], ...) follows priority.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from zeroserve.worker.sequence import Sequence, SequenceStatus


def enqueue(waiting: deque[Sequence], seq: Sequence) -> None:
    """`seq` behind every waiting sequence of its priority or better."""
    if not waiting or waiting[-1].priority <= seq.priority:
        waiting.append(seq)  # the common case: one priority, O(1)
        return
    index = len(waiting)
    while index > 0 and waiting[index - 1].priority > seq.priority:
        index -= 1
    waiting.insert(index, seq)


def requeue_front(waiting: deque[Sequence], seq: Sequence) -> None:
    """`seq` (preempted or resumed) ahead of every waiting sequence of its priority, behind
    every better one."""
    if not waiting or waiting[0].priority >= seq.priority:
        waiting.appendleft(seq)  # the common case: one priority, O(1)
        return
    index = 0
    while index < len(waiting) and waiting[index].priority < seq.priority:
        index += 1
    waiting.insert(index, seq)


def pick_victim(paused: Iterable[Sequence], running: Iterable[Sequence],
                scheduled_ids: set[str], needing: Sequence) -> Sequence | None:
    """The sequence to preempt for `needing`'s blocks: the worst priority among paused
    sequences holding blocks, running ones not scheduled this step, and scheduled ones of a
    worse priority than `needing` (the caller then drops their chunks: `drop_preempted`);
    among equals paused first, then the newest (both iterables are oldest first). None when
    no one can give blocks back."""
    victim: Sequence | None = None
    victim_key: tuple[int, int] | None = None
    for is_paused, seqs in ((1, paused), (0, running)):
        for seq in seqs:
            if is_paused and not seq.block_table:
                continue
            if (not is_paused and seq.request_id in scheduled_ids
                    and seq.priority <= needing.priority):
                continue
            key = (seq.priority, is_paused)
            if victim_key is None or key >= victim_key:  # >=: the newest of equals
                victim, victim_key = seq, key
    return victim


def slot_victim(waiting_head: Sequence, running) -> Sequence | None:
    """With the batch full (max_num_seqs): the running sequence whose slot the first waiting
    one takes, the newest of the worst priority if that is worse than the waiting one's;
    None otherwise (equal priorities wait their turn, as in FCFS). `running` is the
    scheduler's RunQueue (its `priorities` counts, oldest first)."""
    if not running.priorities:
        return None
    worst = max(running.priorities)
    if worst <= waiting_head.priority:
        return None
    for seq in reversed(running):
        if seq.priority == worst:
            return seq
    return None


def drop_preempted(chunks: list, scheduled: list[Sequence],
                   prefills: list[tuple[Sequence, int]]
                   ) -> tuple[list, list[Sequence], list[tuple[Sequence, int]]]:
    """A plan under construction after a scheduled sequence was preempted for a better
    priority: its decode chunk (`chunks` go with the first `len(chunks)` of `scheduled`) or
    its prefill leaves the plan; the rest keep their order."""
    kept = [i for i, seq in enumerate(scheduled[:len(chunks)])
            if seq.status is SequenceStatus.RUNNING]
    prefills = [(seq, n) for seq, n in prefills if seq.status is SequenceStatus.RUNNING]
    decodes = [scheduled[i] for i in kept]
    return [chunks[i] for i in kept], decodes + [seq for seq, _ in prefills], prefills
