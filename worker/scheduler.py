"""Which tokens of which sequences run each step. Plain Python: it plans, the runner executes.

CONTINUOUS (the product): every step is a ragged batch under `max_num_batched_tokens` and
`max_num_seqs`. Running decodes go first (one token each), then unfinished prefills, then new
sequences from the waiting queue, all as chunks that fit the remaining token budget (chunked
prefill), so a long prompt never stalls running streams; beside decodes they take at most
`max_prefill_tokens_with_decodes` (Sarathi's stall-free batching). Sequences that finish or
are aborted leave at once; their slots are refilled from the queue in the next plan. When the block pool
runs out, the newest sequence of the worst priority (of its flow holding the most slots) is
preempted (recompute: its blocks are freed, it goes back to the front of its priority in the
queue and re-prefills prompt + outputs later; tokens already emitted stay). The queue is in
priority order, and a full batch's slots are shared fairly across flows (clients) of one
priority (worker/priority_policy.py).

STATIC and DYNAMIC exist only as benchmark baselines: a batch is taken from the queue (static:
as soon as the engine is idle; dynamic: after `batch_wait_ms` from the first arrival or once
`max_num_seqs` are waiting), its whole prompts are prefilled together and it decodes until its
last member ends, with no admissions in between. Static also keeps finished members computing
a padding row until the batch ends, as a padded batch would. Both reserve each member's full
prompt + max_tokens worth of blocks up front, so they never preempt.

Only `update()` changes state from what the runner returns.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable

from zeroserve.worker import priority_policy
from zeroserve.worker.block_manager import BlockManager
from zeroserve.worker.config import BatchingMode, EngineConfig
from zeroserve.worker.plan import SampledToken, ScheduledChunk, SchedulerOutput, decode_chunk
from zeroserve.worker.run_queue import RunQueue
from zeroserve.worker.scheduler_drafts import accept_drafts, add_drafts
from zeroserve.worker.scheduler_follow import follow_plan, write_tokens
from zeroserve.worker.sequence import FinishReason, RequestError, Sequence, SequenceStatus
from zeroserve.worker.speculative import RecentText, SpecDecodeStats


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self._clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running = RunQueue()  # oldest admission first; preemption takes the last
        self.paused: dict[str, Sequence] = {}  # insertion order: newest last
        self._requests: dict[str, Sequence] = {}  # every unfinished sequence
        # STATIC only: finished members still computing padding rows until the batch ends.
        self._padding: list[Sequence] = []
        # The sequences behind the last plan's chunks (None for a padding row).
        self._last_plan: SchedulerOutput | None = None
        self._last_plan_seqs: list[Sequence | None] = []
        # follow()'s plan behind the last one, and its sequences (the last after update()).
        self._follower: tuple[SchedulerOutput, list[Sequence]] | None = None
        self.num_preemptions = 0
        self._is_plan_cut = False  # this plan lost a scheduled sequence to a preemption
        self._prompt_keys: dict[str, int] = {}  # request id -> hash of its prompt
        # The next step's decodes, made by update() while it holds each sequence (see
        # _next_decodes): their chunks, the sequences behind them, those among them that
        # need a new block first, the running sequences still prefilling, and the run
        # queue's version they are valid for (None: schedule from scratch).
        self._next_chunks: list[ScheduledChunk] = []
        self._next_seqs: list[Sequence] = []
        self._next_needing_block: list[Sequence] = []
        self._next_under_way: list[Sequence] = []
        self._next_version: int | None = None
        self._num_decodes = 0  # how many of the last plan's first chunks are decodes
        self._is_drafting = False  # the last plan's decodes may carry drafts
        self.spec_stats = SpecDecodeStats()  # speculative decoding's counters
        speculative = config.speculative_config
        # Finished requests' text, for drafts where a sequence's own context has none.
        self.recent_text = (RecentText(speculative.prompt_lookup_min,
                                       speculative.prompt_lookup_max, speculative.recent_ngrams)
                            if speculative is not None and speculative.recent_ngrams else None)

    # ---- requests ---------------------------------------------------------------------------

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestError for a request that can never run (the message is user-facing)."""
        if num_prompt_tokens == 0:
            raise RequestError("The prompt must contain at least one token.")
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {total} tokens ({num_prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages "
                "or completion."
            )
        num_blocks = self.block_manager.num_blocks_for(total)
        if num_blocks > self.block_manager.num_total_blocks:
            # Only reachable when max_model_len exceeds the pool; the engine caps it, but a
            # scheduler built directly must still never admit a sequence that cannot fit alone.
            raise RequestError(
                f"This request needs {total} tokens of KV cache but the worker holds only "
                f"{self.block_manager.num_total_blocks * self.block_manager.block_size}. "
                "Please reduce the length of the messages or completion."
            )

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._requests:
            raise RequestError(f"Request id {seq.request_id!r} is already in use.")
        self.check_request(seq.num_prompt_tokens, seq.params.max_tokens)
        seq.status = SequenceStatus.WAITING
        seq.arrival_time = self._clock()
        seq.max_tokens = seq.params.max_tokens
        stop_ids = seq.params.stop_token_ids  # (most requests: none, and one shared set)
        seq.stop_token_ids = self.eos_token_ids.union(stop_ids) if stop_ids else \
            self.eos_token_ids
        p = seq.params
        seq.can_follow = (p.grammar is None and p.repetition_penalty == 1.0
                          and not p.presence_penalty and not p.frequency_penalty)
        self._requests[seq.request_id] = seq
        priority_policy.enqueue(self.waiting, seq)

    def get(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request now and free its blocks; None if unknown or already finished."""
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        self._remove_from_queues(seq)
        self._finish(seq, FinishReason.ABORT)
        return seq

    def finish_with_error(self, request_id: str) -> Sequence | None:
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        self._remove_from_queues(seq)
        self._finish(seq, FinishReason.ERROR)
        return seq

    def pause(self, request_id: str) -> bool:
        """Take a sequence out of the batch; it keeps whatever blocks it holds."""
        seq = self._requests.get(request_id)
        if seq is None or seq.status is SequenceStatus.PAUSED:
            return seq is not None
        self._remove_from_queues(seq)
        seq.status = SequenceStatus.PAUSED
        self.paused[request_id] = seq
        return True

    def resume(self, request_id: str) -> bool:
        seq = self.paused.pop(request_id, None)
        if seq is None:
            return request_id in self._requests
        is_batch_full = (self.config.batching_mode is BatchingMode.CONTINUOUS
                         and len(self.running) >= self.config.max_num_seqs)
        if seq.block_table and is_batch_full:
            # No slot for it now: give its blocks back (full ones stay in the prefix cache,
            # so it recomputes little) and let it take the next free slot.
            self._preempt(seq)
        if seq.block_table:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        else:
            # Never admitted, or preempted while paused: it was ahead of the queue.
            seq.status = SequenceStatus.WAITING
            priority_policy.requeue_front(self.waiting, seq)
        return True

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ---- planning ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        mode = self.config.batching_mode
        if mode is BatchingMode.CONTINUOUS:
            plan, seqs = self._schedule_continuous()
        else:
            plan, seqs = self._schedule_batch(mode)
        self._last_plan, self._last_plan_seqs = plan, seqs
        self._follower = None  # (one left by a step that failed: it never ran)
        return plan

    def follow(self) -> SchedulerOutput | None:
        """The next plan, made while the last one computes, where exact (scheduler_follow)."""
        plan = self._last_plan
        speculative = self.config.speculative_config
        if (plan is None or self._follower is not None or self.waiting or self._is_drafting
                or self._num_decodes != len(plan.chunks)
                or self.config.batching_mode is not BatchingMode.CONTINUOUS
                or (speculative is not None and speculative.is_active(len(self.running)))):
            return None
        self._follower = follow_plan(
            plan, self._last_plan_seqs, len(self.running), self.running.joined,
            self.block_manager, self.max_model_len,
            min(self.config.max_num_batched_tokens, self.config.max_num_seqs))
        return None if self._follower is None else self._follower[0]

    def drop_follower(self) -> None:
        """The plan follow() made did not run (its launch failed, or the plan before it)."""
        self._follower = None

    def _schedule_continuous(self) -> tuple[SchedulerOutput, list[Sequence]]:
        budget = self.config.max_num_batched_tokens
        max_seqs = self.config.max_num_seqs
        chunks: list[ScheduledChunk] = []
        scheduled: list[Sequence] = []  # behind the chunks, in order: decodes, then prefills
        prefills: list[tuple[Sequence, int]] = []
        preempted: list[str] = []

        # 1. Running decodes, oldest first: one token each. update() made them already
        # (_next_decodes) unless that cannot give this loop's plan. Here only a sequence
        # crossing a block boundary allocates.
        block_size = self.block_manager.block_size
        under_way: list[Sequence] = []  # running but not decoding: step 2's candidates
        speculative = self.config.speculative_config
        if speculative is not None and speculative.is_active(len(self.running)):
            made = self._drop_next_decodes()  # drafts are proposed below, one by one
        else:
            speculative = None
            made = self._next_decodes(budget, max_seqs)
        self._is_drafting = speculative is not None
        if made is not None:
            chunks, scheduled, under_way = made
            budget -= len(chunks)
        for seq in list(self.running) if made is None else ():
            if budget == 0 or len(scheduled) == max_seqs:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted above, by a decode that needed its blocks
            chunk = decode_chunk(seq)
            if chunk is None:
                under_way.append(seq)
                continue
            if (chunk.start_pos < len(seq.block_table) * block_size
                    or self._reserve(seq, 1, scheduled, preempted)):
                chunks.append(chunk)
                scheduled.append(seq)
                budget -= 1
        if speculative is not None:
            # Drafts only once every decode holds its own token's slot: they take the
            # budget and the blocks left, and never preempt (worker/scheduler_drafts.py).
            for chunk, seq in zip(chunks, scheduled, strict=True):
                if budget == 0:
                    break
                if seq.status is SequenceStatus.RUNNING:
                    budget -= add_drafts(seq, chunk, speculative, budget, self.block_manager,
                                         len(self.running), self.max_model_len,
                                         self.recent_text)

        budget = self._prefill_budget(budget, chunks)

        # 2. Prefills already under way (chunked prompts, recomputes), as much as fits. Step 1
        # saw every running sequence unless it stopped early, and then this stops at once too.
        for seq in under_way:
            if budget == 0 or len(scheduled) == max_seqs:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # Shrink the chunk to what the pool holds; with no room at all, ask for one
            # block (preempting someone newer) rather than for the whole chunk.
            num_fitting = self._num_fitting_tokens(seq)
            num_new = min(num_new, num_fitting or self.block_manager.block_size)
            if self._reserve(seq, num_new, scheduled, preempted):
                prefills.append((seq, num_new))
                scheduled.append(seq)
                budget -= num_new

        # 3. New sequences from the queue (by priority, then fairly across flows, then FCFS:
        # worker/priority_policy.py; stop at the first that does not fit). Not after a
        # preemption for blocks: the pool is full, and a victim must not bounce straight back.
        # A sequence whose prompt another one is prefilling keeps its place but waits for it,
        # then takes that prompt's blocks from the prefix cache: n choices of one prompt
        # (the gateway sends one SUBMIT each) prefill it once and share its blocks.
        prefilling: set[int] | None = None  # found on first use: most steps admit no one
        num_held = 0
        is_pool_short = bool(preempted)
        if self.waiting and not is_pool_short:
            # With the batch full, a better priority, or a flow holding 2 slots fewer than
            # the one holding the most, takes a slot and is admitted now in its place (the
            # victim waits behind it: it cannot bounce straight back). The free slots go to
            # the flows holding the fewest.
            is_held = priority_policy.held_test(self._sibling_key, self._prompts_in_prefill)
            victim = priority_policy.slot_victim(self.waiting, self.running, max_seqs, is_held)
            if victim is not None:
                self._preempt(victim)
                preempted.append(victim.request_id)
                chunks, scheduled, prefills = priority_policy.drop_preempted(chunks, scheduled,
                                                                             prefills)
                budget = self._prefill_budget(self.config.max_num_batched_tokens - sum(
                    len(chunk.token_ids) for chunk in chunks), chunks) - sum(n for _, n in prefills)
            priority_policy.order_admissions(self.waiting, self.running,
                                             max_seqs - len(self.running), is_held)
        while (len(self.waiting) > num_held and budget > 0 and len(self.running) < max_seqs
               and not is_pool_short):
            if len(scheduled) == max_seqs:
                break
            seq = self.waiting[num_held]
            key = self._sibling_key(seq)
            if key is not None and prefilling is None:
                prefilling = self._prompts_in_prefill()
            if key is not None and key in prefilling:
                num_held += 1
                continue
            num_new = self._admit(seq, budget, num_held)
            if num_new is None:
                break
            if key is not None:
                prefilling.add(key)
            prefills.append((seq, num_new))
            scheduled.append(seq)
            budget -= num_new

        if self._is_plan_cut:  # a scheduled sequence gave its blocks to a better priority
            self._is_plan_cut = False
            chunks, scheduled, prefills = priority_policy.drop_preempted(chunks, scheduled,
                                                                         prefills)
        self._num_decodes = len(chunks)  # the plan's first chunks: one token, sampled
        chunks += [self._chunk(seq, n) for seq, n in prefills]
        return SchedulerOutput(chunks=chunks, preempted=preempted), scheduled

    def _prefill_budget(self, budget: int, decodes: list[ScheduledChunk]) -> int:
        """The prefill budget left beside `decodes`: every stream waits for the whole step,
        so prefills take at most the cap, or as many tokens as there are decodes where that
        is more (the step at most twice a decode step's size: with hundreds of streams
        running, a fixed cap let a burst of arrivals in by a few hundred a step)."""
        cap = self.config.max_prefill_tokens_with_decodes
        return budget if cap is None or not decodes else min(budget, max(cap, len(decodes)))

    def _next_decodes(
        self, budget: int, max_seqs: int
    ) -> tuple[list[ScheduledChunk], list[Sequence], list[Sequence]] | None:
        """Step 1's decode chunks, their sequences and the prefills under way, from what
        update() made for this step. Streams that left the run queue since (paused,
        aborted, preempted) are dropped from them, and those that joined it (resumed, at
        its end) are planned as step 1 plans them. None (plan from scratch) when that
        cannot give exactly step 1's plan: nothing was made, a stream left and came back
        (its place in the order moved), a running sequence is missing, or they do not all
        fit the budget and the pool as they are."""
        version, self._next_version = self._next_version, None
        chunks, seqs = self._next_chunks, self._next_seqs
        needing_block, under_way = self._next_needing_block, self._next_under_way
        self._next_chunks, self._next_seqs = [], []
        self._next_needing_block, self._next_under_way = [], []
        running = self.running
        if version is None:
            return None
        if version != running.version and not self._follow_changes(
                chunks, seqs, needing_block, under_way):
            return None
        bm = self.block_manager
        if (len(seqs) + len(under_way) != len(running)
                or len(seqs) > min(budget, max_seqs)
                or len(needing_block) > bm.num_free_blocks):
            return None
        for seq in needing_block:
            bm.allocate(seq, 1)  # one block each, and the pool has them: no preemption
        return chunks, seqs, under_way

    def _drop_next_decodes(self) -> None:
        """Forget what update() made for this step (the loop plans from scratch)."""
        self._next_version = None
        self._next_chunks, self._next_seqs = [], []
        self._next_needing_block, self._next_under_way = [], []

    def _follow_changes(self, chunks: list[ScheduledChunk], seqs: list[Sequence],
                        needing_block: list[Sequence], under_way: list[Sequence]) -> bool:
        """Bring update()'s lists (changed in place) up to the run queue's changes since;
        False if a stream that left came back."""
        is_running = SequenceStatus.RUNNING
        joined = [seq for seq in dict.fromkeys(self.running.joined)
                  if seq.status is is_running]
        if joined:
            made = {seq.request_id for seq in seqs}
            made.update(seq.request_id for seq in under_way)
            if any(seq.request_id in made for seq in joined):
                return False
        if any(seq.status is not is_running for seq in seqs):
            kept = [k for k, seq in enumerate(seqs) if seq.status is is_running]
            chunks[:] = [chunks[k] for k in kept]
            seqs[:] = [seqs[k] for k in kept]
        needing_block[:] = [seq for seq in needing_block if seq.status is is_running]
        under_way[:] = [seq for seq in under_way if seq.status is is_running]
        for seq in joined:
            self._plan_next(seq, chunks, seqs, needing_block, under_way)
        return True

    def _plan_next(self, seq: Sequence, chunks: list[ScheduledChunk], seqs: list[Sequence],
                   needing_block: list[Sequence], under_way: list[Sequence]) -> None:
        """Add seq to the next step's decodes as step 1 plans it (noting whether its token
        needs a new block), or to the prefills under way."""
        chunk = decode_chunk(seq)
        if chunk is None:
            under_way.append(seq)
            return
        if chunk.start_pos >= len(seq.block_table) * self.block_manager.block_size:
            needing_block.append(seq)
        chunks.append(chunk)
        seqs.append(seq)

    def _schedule_batch(self, mode: BatchingMode) -> tuple[SchedulerOutput, list[Sequence | None]]:
        self._num_decodes = 0  # update() takes every chunk the general way
        self._is_drafting = False
        if not self._is_batch_active():
            self._end_batch()
            if self._is_batch_due(mode):
                self._start_batch()
        running = list(itertools.islice(self.running, self.config.max_num_seqs))
        decodes = [seq for seq in running if self._is_decode(seq)]
        prefills = [seq for seq in running if not self._is_decode(seq)]
        seqs: list[Sequence | None] = [*decodes, *prefills]
        chunks = []
        for seq in seqs:
            num_new = seq.num_tokens - seq.num_computed_tokens
            self.block_manager.allocate(seq, num_new)  # reserved at admission: cannot fail
            chunks.append(self._chunk(seq, num_new))
        for seq in self._padding:
            # Recompute the slot after the last real token: same cost as a decode row, and
            # that slot is in the member's private tail block, which no one else reads.
            chunks.append(self._padding_chunk(seq))
            seqs.append(None)
        return SchedulerOutput(chunks=chunks), seqs

    # ---- state update -------------------------------------------------------------------------

    def update(self, plan: SchedulerOutput, sampled: list[SampledToken]) -> list[Sequence]:
        """Apply one executed plan. Returns the sequences that got a token or finished."""
        if plan is not self._last_plan:
            raise ValueError("update() must get the plan returned by the last schedule()")
        self._last_plan = None
        # Once per stream per step: locals, and _finish_reason only when a stop or a limit
        # may have been reached.
        num_sampled = len(sampled)
        block_size = self.block_manager.block_size
        cache_full_blocks = self.block_manager.cache_full_blocks
        max_model_len = self.max_model_len
        running = SequenceStatus.RUNNING
        changed: list[Sequence] = []
        # The next step's decodes, made here while each sequence is at hand (_next_decodes).
        is_continuous = self.config.batching_mode is BatchingMode.CONTINUOUS
        is_following = self._follower is not None  # then it is the next step's plan
        next_chunks: list[ScheduledChunk] = []
        next_seqs: list[Sequence] = []
        needing_block: list[Sequence] = []
        under_way: list[Sequence] = []
        plan_seqs = self._last_plan_seqs
        if len(plan_seqs) != len(plan.chunks):
            raise ValueError("the plan and its sequences differ")
        num_decodes = self._num_decodes
        if num_sampled < num_decodes:
            raise ValueError("sampled tokens must match the plan's do_sample chunks")
        # The sequences that sampled a token, with it and the number of tokens their chunk
        # computed: the decodes (the plan's first chunks: one token each), then those of
        # the other chunks, in plan order.
        sampling_seqs = plan_seqs[:num_decodes]
        sampling_chunks = plan.chunks[:num_decodes]
        tokens = sampled[:num_decodes]
        nums_new = [1] * num_decodes
        if self._is_drafting:  # (not every step the config allows: 1,000 cold chunks)
            for k, chunk in enumerate(plan.chunks[:num_decodes]):
                if chunk.draft_token_ids:
                    nums_new[k] = len(chunk.token_ids)
        # 1. The other chunks (prefill chunks, and every chunk of the batch modes): those
        # that sample go to step 2; the others are prompts still being prefilled.
        i = num_decodes
        for chunk, seq in zip(plan.chunks[num_decodes:], plan_seqs[num_decodes:],
                              strict=True):
            token = None
            if chunk.do_sample:
                if i < num_sampled:
                    token = sampled[i]
                    i += 1
                if token is None or token.request_id != chunk.request_id:
                    raise ValueError("sampled tokens must match the plan's do_sample chunks")
            if seq is None or seq.status is not running:
                continue  # a padding row: its output is discarded
            num_new = len(chunk.token_ids)
            if token is not None:
                sampling_seqs.append(seq)
                sampling_chunks.append(chunk)
                tokens.append(token)
                nums_new.append(num_new)
                continue
            num_computed = seq.num_computed_tokens = seq.num_computed_tokens + num_new
            if num_computed % block_size < num_new:  # a block just filled up
                cache_full_blocks(seq)
            under_way.append(seq)
        # 2. Every sampled token, the decodes' first: every stream every step, read after a
        # forward that left the CPU caches cold, so this loop reads only the sequence, its
        # sampled token and its output list (no params, no prompt list; the block table only
        # at a block boundary), and writes its chunk.
        for seq, chunk, token, num_new in zip(sampling_seqs, sampling_chunks, tokens, nums_new,
                                              strict=True):
            if token.request_id != seq.request_id:
                raise ValueError("sampled tokens must match the plan's do_sample chunks")
            if num_new > 1 and token.accepted_token_ids is not None:
                # A decode with drafts: its own path (rarer than the plain decode below).
                if self._update_speculative(seq, token, num_new):
                    changed.append(seq)
                    if seq.status is running:
                        self._plan_next(seq, next_chunks, next_seqs, needing_block, under_way)
                continue
            if seq.status is not running or chunk.start_pos != seq.num_computed_tokens:
                continue  # paused since (it computes it again), or a follower's stale row
            num_computed = seq.num_computed_tokens = seq.num_computed_tokens + num_new
            is_block_filled = num_computed % block_size < num_new
            if is_block_filled:
                cache_full_blocks(seq)
            token_id = token.token_id
            outputs = seq.output_token_ids
            outputs.append(token_id)
            changed.append(seq)
            # Its tokens are the computed ones plus the new one. (The sequence's copies of
            # params' limits: params is one more cold object per stream.)
            if (len(outputs) >= seq.max_tokens or token_id in seq.stop_token_ids
                    or num_computed + 1 >= max_model_len):
                reason = self._finish_reason(seq, token_id)
                if reason is not None:
                    self._remove_from_queues(seq)
                    self._finish(seq, reason)
                    continue
            if is_following:
                continue
            # The next step's decode, as _plan_next (and decode_chunk) would make it: this
            # step's chunk moved on by one token. The plan is spent (update() takes it once),
            # so its chunk serves the next one (a new one cost ~0.3 us a stream a step).
            if is_block_filled and num_computed >= len(seq.block_table) * block_size:
                needing_block.append(seq)
            chunk.token_ids = [token_id]
            chunk.start_pos = num_computed
            chunk.block_table = seq.block_table
            chunk.draft_token_ids = None  # (a chunk with drafts took the path above)
            next_chunks.append(chunk)
            next_seqs.append(seq)
        self._last_plan_seqs = []
        if is_continuous:
            self._next_chunks, self._next_seqs = next_chunks, next_seqs
            self._next_needing_block, self._next_under_way = needing_block, under_way
            self._next_version = self.running.version
        self.running.joined = []
        if self._follower is not None:  # it becomes the last plan, with its tokens
            plan, self._last_plan_seqs = self._follower
            self._last_plan, self._follower = write_tokens(plan, sampled), None
            self._num_decodes, self._is_drafting = len(plan.chunks), False
            self._next_version = None  # the next schedule() follows the follower's update
        return changed

    def _update_speculative(self, seq: Sequence, token: SampledToken, num_new: int) -> bool:
        """Apply a decode chunk with drafts (worker/scheduler_drafts.py). False if seq is no
        longer running (paused or preempted meanwhile: it recomputes its last token)."""
        if seq.status is not SequenceStatus.RUNNING:
            if seq.block_table:  # paused: keep room for the token it computes again
                self.block_manager.truncate(seq, seq.num_computed_tokens + 1)
            return False
        reason = accept_drafts(seq, token, num_new, self.block_manager, self.spec_stats,
                               len(self.running), self.eos_token_ids, self.max_model_len,
                               self._finish_reason)
        if reason is not None:
            self._remove_from_queues(seq)
            self._finish(seq, reason)
        return True

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.params
        num_output = seq.num_output_tokens
        # Stops count only once min_tokens real tokens exist before them.
        if num_output > params.min_tokens and (
            (token_id in self.eos_token_ids and not params.ignore_eos)
            or token_id in params.stop_token_ids
        ):
            return FinishReason.STOP
        if num_output >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    # ---- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _is_decode(seq: Sequence) -> bool:
        return seq.num_tokens - seq.num_computed_tokens == 1

    def _chunk(self, seq: Sequence, num_new: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        end = start + num_new
        # The plan borrows the sequence's lists (no per-step copies of the whole context);
        # they are valid until update() appends the sampled tokens.
        return ScheduledChunk(
            request_id=seq.request_id,
            token_ids=_token_slice(seq, start, end),
            start_pos=start,
            block_table=seq.block_table,
            do_sample=end == seq.num_tokens,
            params=seq.params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
        )

    def _padding_chunk(self, seq: Sequence) -> ScheduledChunk:
        last = seq.num_tokens - 1
        return ScheduledChunk(
            request_id=seq.request_id,
            token_ids=[seq.output_token_ids[-1]],
            start_pos=last,
            block_table=seq.block_table,
            do_sample=True,
            params=seq.params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
        )

    def _num_fitting_tokens(self, seq: Sequence) -> int:
        """How many more tokens seq's blocks plus the free pool can hold."""
        bm = self.block_manager
        num_slots = len(seq.block_table) * bm.block_size - seq.num_computed_tokens
        return num_slots + bm.num_free_blocks * bm.block_size

    def _reserve(
        self, seq: Sequence, num_new: int, scheduled: list[Sequence], preempted: list[str]
    ) -> bool:
        """Allocate blocks for num_new tokens of seq, preempting others if needed.

        Victims are paused sequences holding blocks and running sequences not yet scheduled
        this step: the worst priority first, then paused before running, then the newest
        (worker/priority_policy.py). If the only candidate left is seq itself,
        it is preempted and False is returned. The oldest running sequence can always grow,
        since every sequence fits the pool alone (checked at add time): no deadlock.
        """
        bm = self.block_manager
        scheduled_ids: set[str] | None = None  # made only when someone must be preempted
        while not bm.can_allocate(seq, num_new):
            if scheduled_ids is None:
                scheduled_ids = {s.request_id for s in scheduled}
            victim = self._pick_victim(scheduled_ids, seq)
            if victim is None:
                return False
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is seq:
                return False
        bm.allocate(seq, num_new)
        return True

    def _pick_victim(self, scheduled_ids: set[str], seq: Sequence) -> Sequence | None:
        victim = priority_policy.pick_victim(self.paused.values(), self.running,
                                             scheduled_ids, seq)
        if victim is not None and victim.request_id in scheduled_ids:
            self._is_plan_cut = True  # _schedule_continuous drops its chunk
        return victim

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)  # full blocks stay findable in the prefix cache
        self.num_preemptions += 1
        seq.num_preemptions += 1
        if seq.status is SequenceStatus.PAUSED:
            return  # resume() sends it to the front of the queue
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        priority_policy.requeue_front(self.waiting, seq)

    def _sibling_key(self, seq: Sequence) -> int | None:
        """For a new sequence of at least one full prompt block, with prefix caching: a key
        equal for equal prompts (cached per request); else None (nothing to share)."""
        if (not self.block_manager.enable_prefix_caching or seq.num_preemptions
                or seq.num_prompt_tokens <= self.block_manager.block_size
                or seq.params.prompt_logprobs is not None):
            return None
        key = self._prompt_keys.get(seq.request_id)
        if key is None:
            key = self._prompt_keys[seq.request_id] = hash(tuple(seq.prompt_token_ids))
        return key

    def _prompts_in_prefill(self) -> set[int]:
        """Keys of the prompts that running sequences have not finished computing (their
        blocks are in the prefix cache only once computed)."""
        return {key for seq in self.running
                if seq.num_computed_tokens < seq.num_prompt_tokens
                and (key := self._sibling_key(seq)) is not None}

    def _admit(self, seq: Sequence, budget: int, index: int = 0) -> int | None:
        """Move waiting[index] to running with a first chunk; None if it does not fit."""
        bm = self.block_manager
        # Prompt logprobs come from computing the prompt: no cached blocks for those.
        hits = bm.match_prefix(seq) if seq.params.prompt_logprobs is None else []
        # Blocks after those the box's KV tier holds (worker/kv_tier/), loaded at admit.
        num_tier = bm.match_tier(seq, len(hits)) if seq.params.prompt_logprobs is None else 0
        num_new = min(seq.num_tokens - (len(hits) + num_tier) * bm.block_size, budget)
        if not bm.can_admit(seq, hits, num_new, num_tier):
            return None
        del self.waiting[index]
        bm.admit(seq, hits, num_new, num_tier)
        self._mark_scheduled(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return num_new

    def _mark_scheduled(self, seq: Sequence) -> None:
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = self._clock()

    def clock(self) -> float:
        return self._clock()

    def _is_batch_active(self) -> bool:
        # Padding rows alone do not keep a batch going: they only stand in for the finished.
        return bool(self.running) or any(seq.block_table for seq in self.paused.values())

    def _is_batch_due(self, mode: BatchingMode) -> bool:
        if not self.waiting:
            return False
        if mode is BatchingMode.STATIC or len(self.waiting) >= self.config.max_num_seqs:
            return True
        waited_s = self._clock() - self.waiting[0].arrival_time
        return waited_s * 1000.0 >= self.config.batch_wait_ms

    def _start_batch(self) -> None:
        """Take up to max_num_seqs from the queue, reserving each one's whole length."""
        bm = self.block_manager
        num_free = bm.num_free_blocks
        num_reserved = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_needed = bm.num_blocks_for(seq.num_prompt_tokens + seq.params.max_tokens)
            if num_reserved + num_needed > num_free:
                break
            num_reserved += num_needed
            hits = bm.match_prefix(seq)
            self.waiting.popleft()
            bm.admit(seq, hits, 0)
            self._mark_scheduled(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _end_batch(self) -> None:
        for seq in self._padding:
            self.block_manager.forget(seq)
        self._padding = []

    def _remove_from_queues(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.PAUSED:
            del self.paused[seq.request_id]

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark seq finished and release its blocks (STATIC keeps them for padding rows)."""
        keeps_padding = (
            self.config.batching_mode is BatchingMode.STATIC
            and reason in (FinishReason.STOP, FinishReason.LENGTH)
            and bool(seq.block_table)
        )
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if self.recent_text is not None:
            self.recent_text.add(seq.prompt_token_ids, seq.output_token_ids)
        del self._requests[seq.request_id]
        self._prompt_keys.pop(seq.request_id, None)
        if keeps_padding:
            self.block_manager.allocate(seq, 1)  # the padding slot; within its reservation
            self._padding.append(seq)
        else:
            self.block_manager.forget(seq)
        if self._padding and not self._is_batch_active():
            self._end_batch()  # the slowest member is done: release the padded ones now


def _token_slice(seq: Sequence, start: int, end: int) -> list[int]:
    """seq's tokens [start, end) without building the whole prompt + output list."""
    prompt = seq.prompt_token_ids
    num_prompt = len(prompt)
    if end <= num_prompt:
        return prompt[start:end]
    if start >= num_prompt:
        return seq.output_token_ids[start - num_prompt : end - num_prompt]
    return prompt[start:] + seq.output_token_ids[: end - num_prompt]
