"""What the scheduler hands the model runner each step: plain data, no torch.

The scheduler *plans*; the runner *executes* a plan and returns sampled tokens; only
`Scheduler.update()` changes scheduler state from the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from zeroserve.worker.sequence import SamplingParams, Sequence

# ScheduledChunk and SampledToken are made once per stream per step, so they are slotted
# and not frozen (a frozen dataclass's __init__ costs ~0.8 us, a slotted one ~0.16 us).
# Treat them as read-only all the same: a plan is a snapshot of one step, valid until
# Scheduler.update() takes it. update() spends it: the chunks that sampled become the next
# step's decode chunks (moved on by one token) rather than new objects, so a runner must be
# done with a plan when it returns its tokens.


@dataclass(slots=True)
class ScheduledChunk:
    """A contiguous run of one sequence's tokens to push through the model this step."""

    request_id: str
    token_ids: list[int]  # tokens whose K/V are computed now (a prefill chunk, or 1 for decode)
    start_pos: int  # position of token_ids[0]; K/V for positions < start_pos are in the cache
    block_table: list[int]  # covers positions [0, start_pos + len(token_ids))
    do_sample: bool  # True when this chunk reaches the sequence's end: sample one new token
    params: SamplingParams
    # Tokens generated so far (for penalties) and the prompt (for repetition penalty).
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # Speculative decoding: the guessed tokens after the sequence's last one, which are the
    # rest of token_ids (token_ids = [last token, *drafts]); the runner samples a token at
    # every row and keeps the drafts it agrees with (worker/verify.py). None: no drafts.
    draft_token_ids: list[int] | None = None

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's batch. Decode chunks come first, then prefill chunks."""

    chunks: list[ScheduledChunk]
    preempted: list[str] = field(default_factory=list)  # request ids sent back to waiting
    # A plan that follows the one launched before it, made before that one's tokens were
    # known (worker/scheduler_follow.py; only for a runner with `can_follow`): every chunk
    # is one decode row, and where prev_rows[i] is not None its input token is the token
    # the previous plan sampled at that row (its token_ids hold a placeholder until the
    # engine's update of the previous plan writes it in; the runner takes it from its own
    # samples, on the device, and counts it as the sequence's last output token). None: an
    # ordinary plan.
    prev_rows: list[int | None] | None = None

    @cached_property
    def num_tokens(self) -> int:
        # Asked for by the engine and the runner each step: one sum over the chunks.
        return sum([len(c.token_ids) for c in self.chunks])

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class SampledToken:
    """The runner's answer for one chunk with do_sample=True."""

    request_id: str
    token_id: int
    logprob: float | None = None  # logprob of token_id, when params.logprobs is not None
    top_logprobs: list[tuple[int, float]] | None = None  # top-N (token id, logprob)
    # A chunk with drafts: the drafts accepted, which come before token_id (the token
    # sampled after them), and their (logprob, top-N) entries when logprobs are asked for.
    accepted_token_ids: list[int] | None = None
    accepted_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


def decode_chunk(seq: Sequence) -> ScheduledChunk | None:
    """seq's next decode chunk (its one token not yet computed), or None when it has more
    than one to compute (a prefill under way). The plan borrows the sequence's lists (see
    Scheduler._chunk). Scheduler.update()'s decode loop makes the same chunk inline."""
    start = seq.num_computed_tokens
    prompt = seq.prompt_token_ids
    outputs = seq.output_token_ids
    if len(prompt) + len(outputs) - start != 1:
        return None
    return ScheduledChunk(seq.request_id, [outputs[-1] if outputs else prompt[-1]], start,
                          seq.block_table, True, seq.params, prompt, outputs)
