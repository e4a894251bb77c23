"""One request's state inside a worker: the scheduler owns it, the others borrow it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from zeroserve.worker.draft_policy import DraftState
from zeroserve.worker.grammar import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no blocks (new, or preempted for recompute)
    RUNNING = "running"  # holds blocks; scheduled every step
    PAUSED = "paused"  # holds blocks; left out of the batch until resumed (no credit)
    FINISHED = "finished"  # blocks released


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # caller aborted (client gone, stop string seen by the gateway)
    ERROR = "error"  # worker-side failure (slow client timeout, engine error)


MIN_TEMPERATURE = 1e-5  # temperatures below this sample greedily
MAX_LOGIT_BIAS = 1024  # token ids one request may bias


class RequestError(ValueError):
    """A request the engine cannot take (too long, bad parameters). Message is user-facing."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. Validated here so every entry point shares the checks."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token; None means off
    # Logprobs of the prompt's tokens (each given the ones before it), with the top-N
    # alternatives; None means off. Such a request computes its whole prompt (no cache hits).
    prompt_logprobs: int | None = None
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The request's grammar and its matcher (worker/grammar.py): one object per request,
    # compared by identity; None means unconstrained.
    grammar: GrammarState | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError("min_tokens must be between 0 and max_tokens")
        if self.temperature < 0:
            raise RequestError("temperature must be >= 0")
        if self.top_k < 0:
            raise RequestError("top_k must be >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise RequestError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise RequestError("repetition_penalty must be > 0")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise RequestError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise RequestError("logprobs must be between 0 and 20")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise RequestError("prompt_logprobs must be between 0 and 20")
        bias = self.logit_bias
        if bias is None or isinstance(bias, dict):  # {id: bias} from a local caller
            bias = () if bias is None else tuple(bias.items())
        if len(bias) > MAX_LOGIT_BIAS or not all(
                isinstance(pair, (list, tuple)) and len(pair) == 2 and type(pair[0]) is int
                and pair[0] >= 0 and isinstance(pair[1], (int, float))
                and not isinstance(pair[1], bool) and -100 <= pair[1] <= 100
                for pair in bias):
            raise RequestError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to "
                               "biases in [-100, 100]")
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in bias))

    @property
    def is_greedy(self) -> bool:
        # Below MIN_TEMPERATURE, logits / temperature overflows to inf and the softmax to NaN;
        # such a temperature means "the most likely token" anyway (vLLM draws the same line).
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


@dataclass(eq=False, slots=True)
class Sequence:
    """A request as the engine sees it. Token lists grow; blocks come and go.

    Compared by identity (one object per request): the scheduler's queues find and remove
    sequences with ==, which as a field-by-field comparison cost ~0.5 us per element passed.
    Slotted: the scheduler reads a handful of its fields per stream per step, and after a
    20 ms forward those reads miss the CPU caches; slots keep them in the object itself.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    # KV state: physical block ids in logical order, and how many tokens have K/V in them.
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at the last admission (for stats/usage).
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Output tokens not yet handed out by engine.step() (kept across preemption).
    num_emitted_tokens: int = 0
    # params.prompt_logprobs: entries for prompt positions 1.. as the prefill computes them
    # ((logprob, [(id, logprob), ...]) each); handed out once, with the first output.
    prompt_logprobs: list | None = None
    is_prompt_logprobs_sent: bool = False
    # Scheduler clock: when it first got KV blocks, and when it first produced a token here.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Output tokens (in all, counting earlier ones) this stream may have before it must
    # pause for credit (the worker process sets it); caps speculative drafts. None: no cap.
    credit_limit: int | None = None
    # Speculative decoding: how often this sequence's drafts were right, which sizes its next
    # proposals (worker/draft_policy.py). None until it first proposes; this worker's only.
    draft_state: DraftState | None = None
    # Lower is served first, 0 by default (SUBMIT's priority; worker/priority_policy.py).
    priority: int = 0
    # The client it serves, hashed (SUBMIT's flow; 0: none): a full batch's slots are shared
    # fairly across the flows of one priority (worker/priority_policy.py).
    flow: int = 0
    # For Scheduler.update()'s check of every sampled token, set by Scheduler.add from
    # params (which update() then need not read, cold, per stream per step): params'
    # max_tokens, and the ids that may stop it (EOS and params.stop_token_ids). update() only
    # asks _finish_reason when one of them is reached, so these defaults (before add) ask
    # it every time.
    max_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    # Whether its next step may be planned before its last token is known (no grammar, no
    # penalty: worker/scheduler_follow.py), set by Scheduler.add from params.
    can_follow: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
