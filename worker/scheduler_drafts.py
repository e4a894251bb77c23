"""Speculative drafts in the scheduler's plan and in its update. Plain Python, no torch.

The scheduler (worker/scheduler.py) calls `add_drafts` on the decode chunks of a step once
every running decode has reserved the slot of its own token: drafts take only the token
budget and the KV blocks left after that, so they never delay a decode nor preempt anyone.
After the runner verified a chunk with drafts, `accept_drafts` moves the accepted ones and
the sampled token into the sequence, each checked for a stop or a limit as plain decoding
checks it, and gives the rejected drafts' slots back.

Proposing drafts is worker/speculative.py (n-gram prompt lookup), how many a sequence gets
is worker/draft_policy.py, and checking them against the model is worker/verify.py.
"""

from __future__ import annotations

from collections.abc import Callable

from zeroserve.worker import draft_policy
from zeroserve.worker.block_manager import BlockManager
from zeroserve.worker.draft_policy import DraftState
from zeroserve.worker.plan import SampledToken, ScheduledChunk
from zeroserve.worker.sequence import FinishReason, Sequence
from zeroserve.worker.speculative import (
    RecentText,
    SpecDecodeStats,
    SpeculativeConfig,
    propose_ngram,
)


def add_drafts(seq: Sequence, chunk: ScheduledChunk, config: SpeculativeConfig,
               budget: int, bm: BlockManager, num_running: int, max_model_len: int,
               recent_text: RecentText | None) -> int:
    """Put n-gram drafts after a decode chunk's token, whose slot seq holds already, as many
    as every limit allows: as many as pay for their rows given how often this sequence's
    drafts were right (at most k), `budget` (the step's tokens left), max_tokens and the
    context (the token after the drafts must fit too), the stream's credit, and the free
    blocks, which it takes. A constrained request's drafts end before the first token its
    grammar forbids. Returns how many drafts the chunk got."""
    params = seq.params
    num_output = len(seq.output_token_ids)
    num_tokens = seq.num_prompt_tokens + num_output
    state = seq.draft_state
    if state is None:
        state = seq.draft_state = DraftState()
    k = min(draft_policy.num_drafts(state, num_tokens, num_running,
                                    config.num_speculative_tokens),
            budget, params.max_tokens - num_output - 1, max_model_len - num_tokens - 1)
    if seq.credit_limit is not None:
        k = min(k, seq.credit_limit - num_output - 1)
    if k < 1:
        return 0
    tokens = seq.all_token_ids
    drafts = propose_ngram(tokens, config.prompt_lookup_min, config.prompt_lookup_max, k)
    if not drafts and recent_text is not None:
        drafts = recent_text.propose(tokens, k)
    if drafts and params.grammar is not None:
        drafts = drafts[:params.grammar.num_allowed(seq.output_token_ids, drafts)]
    if not drafts:
        return 0
    num_slots = len(seq.block_table) * bm.block_size - chunk.start_pos
    num_free = num_slots + bm.num_free_blocks * bm.block_size
    drafts = drafts[:max(0, num_free - 1)]  # the chunk's own token holds the first slot
    if not drafts:
        return 0
    chunk.token_ids = chunk.token_ids + drafts
    chunk.draft_token_ids = drafts
    bm.allocate(seq, len(chunk.token_ids))  # within the free blocks counted above
    return len(drafts)


def accept_drafts(seq: Sequence, token: SampledToken, num_new: int, bm: BlockManager,
                  stats: SpecDecodeStats, num_running: int, eos_token_ids: frozenset[int],
                  max_model_len: int,
                  finish_reason: Callable[[Sequence, int], FinishReason | None],
                  ) -> FinishReason | None:
    """Apply a running sequence's decode chunk with drafts: its last token and the accepted
    drafts are computed, the rejected drafts' K/V slots are given back (the block table
    shrinks to the verified tokens; blocks taken only for rejected ones return to the pool),
    then the accepted drafts and the sampled token are appended one by one, each checked for
    a stop or a limit as plain decoding checks it (`finish_reason`): none is appended after
    one that ends the sequence. Returns the reason it finished, if it did (the caller
    finishes it)."""
    accepted = token.accepted_token_ids or []
    stats.record(num_new - 1, len(accepted))
    if seq.draft_state is not None:
        draft_policy.record(seq.draft_state, num_new - 1, len(accepted),
                            seq.num_tokens + len(accepted) + 1, num_running)
    outputs = seq.output_token_ids
    params = seq.params
    reason = None
    for token_id in (*accepted, token.token_id):
        outputs.append(token_id)
        if (len(outputs) >= params.max_tokens or token_id in eos_token_ids
                or token_id in params.stop_token_ids or seq.num_tokens >= max_model_len):
            reason = finish_reason(seq, token_id)
            if reason is not None:
                break
    # Computed: the last token and the accepted drafts (fewer where a stop cut them).
    seq.num_computed_tokens = min(seq.num_computed_tokens + 1 + len(accepted),
                                  seq.num_tokens - 1)
    bm.truncate(seq, seq.num_computed_tokens)
    bm.cache_full_blocks(seq)  # verified tokens only, now in the token lists
    return reason
