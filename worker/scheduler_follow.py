"""The next decode step, planned while the current one computes (asynchronous scheduling).

After a forward the engine thread's serial work (the state update, the next plan) used to
sit between two forwards: a step was the forward plus about 1.5 ms at 1,000 streams. A runner
whose device queues work (`can_follow`: a CUDA stream; the fake runner models one) can take
step n+1 before step n's tokens reach the CPU, so the engine launches it right behind step n
and does step n's update while it runs: a step is then the forward alone.

Such a plan is made only when it is exactly what step n's update and the scheduler would
plan next, given that every running decode of step n goes on:

- every running sequence decodes in step n (no prefill, no drafts, no admission pending:
  nothing waiting), and speculation is off at this batch size (drafts need the token);
  a stream resumed since (back from a pause for credit) gets the decode a plan from
  scratch would give it, its known last token at its computed length;
- no sequence of the step has a grammar or a penalty (those read the token on the CPU
  side; worker/sequence.py's `can_follow`); the runner counts the pending token as the
  sequence's last output (sampling seeds, min_tokens);
- a sequence that step n ends by length (max_tokens, the context) gets no row; one that step
  n ends by a stop token does, and update() drops that row's token, as it drops any row that
  no longer continues its sequence (paused, aborted, preempted: its start is not the
  sequence's computed length);
- the rows fit the step's token budget and sequence cap, and those crossing into a new
  block get it now, from free blocks only (no preemption).

The price: a request that arrives while a step is queued behind another is admitted by the
step after it (up to one forward later than without). The engine does not follow with the
box's KV tier on (its flush must come between update and the next step).

A finished sequence's extra row writes K/V into a block freed after it was launched: the
device runs the steps in order, so any later owner's writes come after it, and the row
writes only the position after the sequence's computed tokens, never a block the prefix
cache holds.
"""

from __future__ import annotations

from zeroserve.worker.block_manager import BlockManager
from zeroserve.worker.plan import SampledToken, ScheduledChunk, SchedulerOutput, decode_chunk
from zeroserve.worker.sequence import Sequence, SequenceStatus


def follow_plan(
    plan: SchedulerOutput, seqs: list[Sequence], num_running: int, joined: list[Sequence],
    block_manager: BlockManager, max_model_len: int, max_num_rows: int,
) -> tuple[SchedulerOutput, list[Sequence]] | None:
    """The decode plan after `plan` (every chunk one decode of seqs[i], all of them running
    when it was made), its token ids pending; None where it would not be exact. `joined`:
    the sequences that joined the run queue since the last update() (resumed streams);
    `max_num_rows`: the step's token budget and sequence cap (a plan from scratch leaves
    decodes beyond it out)."""
    # Once per stream per step, beside a forward: locals, and the sequence's own fields.
    running = SequenceStatus.RUNNING
    block_size = block_manager.block_size
    chunks: list[ScheduledChunk] = []
    followers: list[Sequence] = []
    prev_rows: list[int | None] = []
    needing_block: list[Sequence] = []
    resumed: list[Sequence] = []  # rows update() will drop, of running sequences
    new_chunk, add_chunk, add_follower, add_row = (ScheduledChunk, chunks.append,
                                                   followers.append, prev_rows.append)
    num_running_rows = 0
    for row, (chunk, seq) in enumerate(zip(plan.chunks, seqs, strict=True)):
        if seq.status is not running:
            continue  # paused or ended since: update() drops its token
        num_running_rows += 1
        if not seq.can_follow:
            return None
        if chunk.start_pos != seq.num_computed_tokens:
            resumed.append(seq)  # paused and resumed since it was planned: update() drops it
            continue
        position = chunk.start_pos + 1  # of the token this row computes
        outputs = seq.output_token_ids
        if len(outputs) + 1 >= seq.max_tokens or position + 1 >= max_model_len:
            continue  # the token computing now is its last (update() ends it by length)
        table = seq.block_table  # (covers `position` unless it starts a block)
        if position % block_size == 0 and position >= len(table) * block_size:
            needing_block.append(seq)
        add_chunk(new_chunk(seq.request_id, [0], position, table, True, seq.params,
                            seq.prompt_token_ids, outputs))
        add_follower(seq)
        add_row(row)
    if joined:  # resumed streams with no row in `plan`
        in_plan = set(map(id, seqs))
        not_in_plan = [seq for seq in dict.fromkeys(joined)
                       if seq.status is running and id(seq) not in in_plan]
        num_running_rows += len(not_in_plan)
        resumed += not_in_plan
    # A resumed stream's next decode is the one a plan from scratch gives it: its known
    # last token, at its computed length (its rows in flight, if any, are dropped).
    needing_one_block: list[Sequence] = []
    for seq in resumed:
        chunk = decode_chunk(seq)
        if chunk is None or not seq.can_follow:
            return None  # (a prefill under way)
        if chunk.start_pos >= len(seq.block_table) * block_size:
            needing_one_block.append(seq)
        chunks.append(chunk)
        followers.append(seq)
        prev_rows.append(None)  # its token is known
    if (num_running_rows != num_running or not chunks or len(chunks) > max_num_rows
            or len(needing_block) + len(needing_one_block) > block_manager.num_free_blocks):
        return None
    for seq in needing_block:
        block_manager.allocate(seq, 2)  # its token computing now, and this row's
    for seq in needing_one_block:
        block_manager.allocate(seq, 1)
    return SchedulerOutput(chunks, prev_rows=prev_rows), followers


def write_tokens(plan: SchedulerOutput, sampled: list[SampledToken]) -> SchedulerOutput:
    """Fill a follower's pending token ids in from the tokens its previous plan sampled (the
    runner took them on the device): it is then an ordinary plan, which a runner may run
    again chunk by chunk (Engine._isolate) and update() moves on as it moves any."""
    for chunk, row in zip(plan.chunks, plan.prev_rows, strict=True):
        if row is not None:
            chunk.token_ids[0] = sampled[row].token_id
    return plan
