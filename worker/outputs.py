"""What the engine returns from a step: plain data that the worker process puts on the wire."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from zeroserve.worker.kv_tier.store import TierCounters
from zeroserve.worker.sequence import FinishReason
from zeroserve.worker.speculative import SpecDecodeStats


class RequestOutput(NamedTuple):
    """New tokens of one request from one step (possibly none, when it only finished).

    A named tuple (read-only): one is made per stream per step, and the engine makes it with
    tuple.__new__, in C (a slotted dataclass's __init__ took ~0.35 us of each, this ~0.15)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int  # total so far, including new_token_ids
    num_cached_tokens: int = 0
    # One entry per new token when logprobs were asked for: (logprob, [(id, logprob), ...]).
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # The prompt's logprobs (params.prompt_logprobs), on the first output only: one entry
    # per prompt token after the first, in the shape of `logprobs`.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    error: str | None = None  # user-facing message when finish_reason is ERROR
    # With this request's first token here: (seconds queued, seconds from scheduled to it).
    timings: tuple[float, float] | None = None
    # With ERROR: why, for the gateway (common.protocol.POISON_REQUEST: it failed alone).
    error_code: str | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepTiming:
    schedule_s: float = 0.0
    prepare_s: float = 0.0  # building input tensors
    forward_s: float = 0.0  # the model forward itself
    sample_s: float = 0.0
    update_s: float = 0.0  # scheduler state update and output building
    num_tokens: int = 0
    num_seqs: int = 0

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.forward_s + self.sample_s + self.update_s


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_paused: int
    num_free_blocks: int
    num_cached_blocks: int  # free but still holding a reusable prefix
    num_total_blocks: int
    num_preemptions: int
    num_steps: int
    num_prefix_queries: int = 0  # prompt tokens looked up in the prefix cache (first admission)
    num_prefix_hits: int = 0  # ... and found there
    last_step: StepTiming = field(default_factory=StepTiming)
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # cumulative
    kv_tier: TierCounters | None = None  # the box's KV tier, cumulative; None: off
