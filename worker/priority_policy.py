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
  admitted in its place.
- Fair across flows (SUBMIT.flow: the client, an API key, as the gateway hashed it) within
  one priority: of the waiting sequences of the best priority, the one whose flow holds the
  fewest running slots of that priority is admitted first; with the batch full it takes a
  slot from the flow holding the most, if that one holds at least 2 more (so the shares
  converge to within one slot and never swap back and forth). Priority beats flows: a
  better priority's sequences are never preempted for a flow's share.
- A slot's victim is the newest running sequence of the flow holding the most slots among
  those of the worst priority; the newest has the least context to recompute, and it waits
  at the front of its priority, ahead of its flow's other waiting sequences.
- No slot is taken for a sequence that cannot start this step: one of n choices whose
  prompt a running sibling is still prefilling (the scheduler holds it until that prompt's
  blocks are in the prefix cache). Its slot would go straight back to the sequence just
  preempted for it: a recompute for nothing, every step of the sibling's prefill.
- Under KV pressure the victim is the worst priority holding blocks; among equals a paused
  sequence (idle without credit) before a running one, then the flow holding the most
  running slots, and the newest first. So a lower class is always preempted before a higher
  one, and with one flow (or every flow 0) the order within one priority is the old one.

Plain Python, no torch. Invariant: the queue stays sorted by priority (stable), so admission
(the scheduler takes waiting[0], waiting[1], ...) follows priority. The flow rule reorders
only the first MAX_FAIR_SCAN waiting sequences of the best priority, and takes at most one
slot a step (the gateway keeps a worker's queue short; the engine used directly with
thousands waiting looks no further, so a step's cost stays bounded). With one flow it moves
nothing.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable

from zeroserve.worker.sequence import Sequence, SequenceStatus

# How many waiting sequences of the best priority the flow rule looks at each step.
MAX_FAIR_SCAN = 128
# A flow takes a full batch's slot from another only when that one holds this many more.
MIN_SLOT_LEAD = 2


def _never(seq: Sequence) -> bool:
    return False


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


def held_test(sibling_key: Callable[[Sequence], int | None],
              prompts_in_prefill: Callable[[], set[int]]) -> Callable[[Sequence], bool]:
    """`is_held` for one step: is a waiting sequence one of n choices whose prompt a running
    sibling is prefilling (the scheduler passes over it: it takes that prompt's blocks from
    the prefix cache once they are computed)? `sibling_key(seq)`: its prompt's key, None for
    one that shares nothing; `prompts_in_prefill()`: the keys being prefilled, asked once
    and only when a sequence has a key."""
    prefilling: set[int] | None = None

    def is_held(seq: Sequence) -> bool:
        nonlocal prefilling
        key = sibling_key(seq)
        if key is None:
            return False
        if prefilling is None:
            prefilling = prompts_in_prefill()
        return key in prefilling

    return is_held


def pick_victim(paused: Iterable[Sequence], running, scheduled_ids: set[str],
                needing: Sequence) -> Sequence | None:
    """The sequence to preempt for `needing`'s blocks: the worst priority among paused
    sequences holding blocks, running ones not scheduled this step, and scheduled ones of a
    worse priority than `needing` (the caller then drops their chunks: `drop_preempted`);
    among equals paused first, then the flow holding the most running slots of that
    priority, then the newest (both iterables are oldest first). `running` is the
    scheduler's RunQueue. None when no one can give blocks back."""
    flows = running.flows
    victim: Sequence | None = None
    victim_key: tuple[int, int, int] | None = None
    for is_paused, seqs in ((1, paused), (0, running)):
        for seq in seqs:
            if is_paused and not seq.block_table:
                continue
            if (not is_paused and seq.request_id in scheduled_ids
                    and seq.priority <= needing.priority):
                continue
            key = (seq.priority, is_paused, flows.get((seq.priority, seq.flow), 0))
            if victim_key is None or key >= victim_key:  # >=: the newest of equals
                victim, victim_key = seq, key
    return victim


def slot_victim(waiting: deque[Sequence], running, max_num_seqs: int,
                is_held: Callable[[Sequence], bool] = _never) -> Sequence | None:
    """With the batch full and `waiting` not empty: the running sequence whose slot a waiting
    one takes, or None. `running` is the scheduler's RunQueue (its `priorities` and `flows`
    counts, oldest first). `is_held(seq)`: seq cannot start this step (one of n choices
    whose prompt a sibling is prefilling): no slot is taken for it, since the slot would
    go straight back to the sequence preempted for it.

    - A worse priority running than the first waiting one not held: the newest of the flow
      holding the most slots of the worst priority.
    - Else the newest of the flow holding the most slots of that one's priority, if that
      flow holds MIN_SLOT_LEAD more than the waiting flow (not held) holding the fewest
      (among the first MAX_FAIR_SCAN waiting of that priority). One flow: None.
    """
    if len(running) < max_num_seqs or not running.priorities:
        return None
    # Without `is_held` first: it only makes a victim less likely, and the common cases
    # (one flow, nobody better waiting) end here without a look at anyone's prompt.
    if _slot_victim(waiting, running, _never) is None:
        return None
    return _slot_victim(waiting, running, is_held)


def _slot_victim(waiting: deque[Sequence], running,
                 is_held: Callable[[Sequence], bool]) -> Sequence | None:
    if is_held is _never:
        head = waiting[0]
    else:
        head = next((seq for seq in itertools.islice(waiting, MAX_FAIR_SCAN)
                     if not is_held(seq)), None)
        if head is None:
            return None
    worst = max(running.priorities)
    if worst > head.priority:
        return _newest_of_largest_flow(running, worst)
    counts = _flow_counts(running, head.priority)
    if not counts:
        return None
    if is_held is _never and waiting[-1].priority == head.priority:
        # Every waiting one is of this priority (the queue is sorted): their flows as a set
        # first (one flow, the common case, gives a set of one).
        flows = {seq.flow for seq in itertools.islice(waiting, MAX_FAIR_SCAN)}
        fewest = min(counts.get(flow, 0) for flow in flows)
    else:
        fewest = min(counts.get(seq.flow, 0) for seq in _window(waiting, head.priority)
                     if not is_held(seq))
    if max(counts.values()) - fewest < MIN_SLOT_LEAD:
        return None
    return _newest_of_largest_flow(running, head.priority)


def order_admissions(waiting: deque[Sequence], running, num_free: int,
                     is_held: Callable[[Sequence], bool] = _never) -> None:
    """Before `num_free` slots are filled from `waiting` (not empty): its front reordered so
    that each next admission goes to the waiting flow holding the fewest running slots of
    the first one's priority (counting those admitted before it; ties: the oldest). Only the
    first MAX_FAIR_SCAN waiting of that priority move; with one flow nothing does. Those
    `is_held` (they wait for a sibling's prompt: the scheduler passes over them) are not
    chosen and keep their order behind the chosen."""
    if num_free <= 0:
        return
    priority = waiting[0].priority
    if (waiting[-1].priority == priority
            and len({seq.flow for seq in itertools.islice(waiting, MAX_FAIR_SCAN)}) == 1):
        return  # one priority and one flow waiting: its own order (the common case)
    window = list(_window(waiting, priority))
    first_flow = window[0].flow
    if all(seq.flow == first_flow for seq in window):
        return  # one flow waiting of the best priority: its own order
    candidates = [seq for seq in window if not is_held(seq)]
    counts = _flow_counts(running, priority)
    # Each flow's waiting sequences in order; a heap of (its slots, its oldest's place).
    queues: dict[int, deque[tuple[int, Sequence]]] = {}
    for index, seq in enumerate(candidates):
        queues.setdefault(seq.flow, deque()).append((index, seq))
    heap = [(counts.get(flow, 0), queue[0][0], flow) for flow, queue in queues.items()]
    heapq.heapify(heap)
    order: list[Sequence] = []
    while heap and len(order) < num_free:
        held, _, flow = heapq.heappop(heap)
        queue = queues[flow]
        order.append(queue.popleft()[1])
        if queue:
            heapq.heappush(heap, (held + 1, queue[0][0], flow))
    if all(a is b for a, b in zip(order, candidates, strict=False)):
        return  # already in this order (FIFO is fair here): nothing moves
    chosen = {id(seq) for seq in order}
    rest = [seq for seq in window if id(seq) not in chosen]
    for _ in window:
        waiting.popleft()
    waiting.extendleft(reversed(order + rest))


def _window(waiting: deque[Sequence], priority: int):
    """The waiting sequences of `priority` among the first MAX_FAIR_SCAN (those of a better
    one before them are passed over; the first of a worse one ends it)."""
    for seq in itertools.islice(waiting, MAX_FAIR_SCAN):
        if seq.priority > priority:
            return
        if seq.priority == priority:
            yield seq


def _flow_counts(running, priority: int) -> dict[int, int]:
    """flow -> its running sequences of `priority`."""
    return {flow: n for (p, flow), n in running.flows.items() if p == priority}


def _newest_of_largest_flow(running, priority: int) -> Sequence | None:
    """The newest running sequence of `priority` among those of the flow holding the most
    running slots of it."""
    counts = _flow_counts(running, priority)
    if not counts:
        return None
    most = max(counts.values())
    for seq in reversed(running):
        if seq.priority == priority and counts[seq.flow] == most:
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
