"""n-gram (prompt-lookup) speculative decoding: its settings, the proposer and its counters.
Plain Python over token ids, no torch: the scheduler proposes, the runner verifies.

A running sequence's next tokens are guessed from its own context (prompt + outputs so far):
the latest earlier occurrence of its last n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) was followed by some tokens; up to k of them are proposed. The step then
computes the sequence's last token and the k draft tokens in one chunk (1 + k query rows over
its cached K/V) and samples a token at every row; worker/verify.py keeps the drafts the model
agrees with. Output that repeats the input (rewrite, extract, edit, code) is produced several
tokens per forward; where nothing matches, a sequence decodes as usual.

Where a sequence's own context has no match, the drafts may come from text this worker
finished lately for other requests (RecentText).

Settings follow vLLM's `--speculative-config` JSON: {"method": "ngram",
"num_speculative_tokens": 7, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
"disable_by_batch_size": 8}, plus "recent_ngrams": 100000 (RecentText's size; 0 turns it
off) (the defaults). How many drafts a sequence proposes, up to num_speculative_tokens,
follows how often its drafts were right (worker/draft_policy.py).
"""

from __future__ import annotations

import json
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from zeroserve.common.protocol import SPEC_DECODE_PER_POS_COUNTER

METHODS = ("ngram",)
# At most this many drafts per step: each position's acceptance is its own worker counter
# (common/protocol.py: MAX_COUNTERS), and longer guesses are rarely all right.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    # k: drafts per sequence per step, at most. 7: on the CPU a step of 1 + 7 rows still
    # costs about 0.17 of a 1-row step per row, and a ninth costs over 3 rows (benchmarks.md,
    # "Adaptive n-gram speculation"); worker/draft_policy.py proposes fewer where they fail.
    num_speculative_tokens: int = 7
    prompt_lookup_max: int = 4  # the longest n-gram looked up
    prompt_lookup_min: int = 2  # the shortest (a shorter match proposes nothing)
    # Steps with more running sequences than this decode normally (verifying drafts costs
    # compute a large batch no longer has spare; up to it, worker/draft_policy.py asks more
    # of a draft the larger the batch). None: any batch may speculate.
    disable_by_batch_size: int | None = 8
    # n-grams of finished requests' outputs this worker keeps (RecentText): where a
    # sequence's own context has no match, its drafts may come from text generated lately
    # for others (SGLang's n-gram and llama.cpp's lookup caches do the same). 0: a
    # sequence's own context only.
    recent_ngrams: int = 100_000

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, "
                             f"not {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError("num_speculative_tokens must be between 1 and "
                             f"{MAX_SPECULATIVE_TOKENS}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")
        if self.recent_ngrams < 0:
            raise ValueError("recent_ngrams must be >= 0")

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> SpeculativeConfig | None:
        """vLLM's JSON (a string or a parsed dict); None for an empty one or {"method": null}
        (no speculation). Raises ValueError with a user-facing message."""
        if isinstance(text, str):
            if not text.strip():
                return None
            try:
                text = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if text is None:
            return None
        if not isinstance(text, dict):
            raise ValueError("speculative config must be a JSON object")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(text) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys: {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        if "method" in text and text["method"] is None:
            return None
        for key, value in text.items():
            is_int = type(value) is int
            if key != "method" and not is_int and not (
                    key == "disable_by_batch_size" and value is None):
                raise ValueError(f"speculative config {key} must be an integer")
        values = dict(text)
        # vLLM: prompt_lookup_min defaults to prompt_lookup_max when only that is given,
        # and the reverse.
        if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
            values["prompt_lookup_min"] = min(values["prompt_lookup_max"],
                                              cls.prompt_lookup_min)
        if "prompt_lookup_min" in values and "prompt_lookup_max" not in values:
            values["prompt_lookup_max"] = max(values["prompt_lookup_min"],
                                              cls.prompt_lookup_max)
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps({"method": self.method,
                           "num_speculative_tokens": self.num_speculative_tokens,
                           "prompt_lookup_max": self.prompt_lookup_max,
                           "prompt_lookup_min": self.prompt_lookup_min,
                           "disable_by_batch_size": self.disable_by_batch_size,
                           "recent_ngrams": self.recent_ngrams})

    def is_active(self, num_running: int) -> bool:
        """Whether a step with num_running sequences speculates."""
        limit = self.disable_by_batch_size
        return limit is None or num_running <= limit


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of tokens' last n tokens,
    for the largest n in [min_n, max_n] that occurs earlier; [] when none does.

    One pass over the earlier occurrences of the last token, latest first (found by
    list.index, in C), each extended backwards up to max_n: the longest match wins, the
    latest among equals. About 20 us for a 1,000-token context where nothing matches."""
    num_tokens = len(tokens)
    max_n = min(max_n, num_tokens - 1)
    if k < 1 or max_n < min_n:
        return []
    backwards = tokens[::-1]  # backwards[j] is tokens[num_tokens - 1 - j]
    last = backwards[0]
    best_len, best_end = 0, 0
    j = 1
    while True:
        try:
            j = backwards.index(last, j)
        except ValueError:
            break
        # tokens[num_tokens - 1 - j] == last: how far back does the match go?
        n = 1
        while n < max_n and j + n < num_tokens and backwards[j + n] == backwards[n]:
            n += 1
        if n > best_len:
            best_len, best_end = n, num_tokens - j
            if n == max_n:
                break
        j += 1
    if best_len < min_n:
        return []
    return tokens[best_end:best_end + k]


class RecentText:
    """The n-grams (prompt_lookup_min..max tokens) of text finished lately on this worker,
    each mapped to where it last occurred, so that a sequence whose own context has no match
    can take its drafts from what followed the same words in another request's output. The
    model verifies every draft, so a request's tokens are those it gets without this table;
    only how many tokens a step yields changes.

    What is kept: each finished request's output and the few prompt tokens before it, up to
    `capacity` n-grams, the oldest dropped first. As with prefix caching, a client that times
    its own requests could tell whether text was generated lately for someone else;
    `recent_ngrams` 0 turns the table off."""

    def __init__(self, min_n: int, max_n: int, capacity: int):
        self.min_n, self.max_n, self.capacity = min_n, max_n, capacity
        # n-gram -> (the text it occurred in, the index just after it there), oldest first
        self._next: OrderedDict[tuple[int, ...], tuple[list[int], int]] = OrderedDict()
        # Texts finished but not indexed yet, oldest first, with their n-gram counts: indexed
        # when a draft is next asked for, so a step in which many requests finish (at a
        # batch size where drafting is off) does no indexing at all. Only the newest texts
        # whose n-grams fill the table are kept; older ones would be evicted by them anyway.
        self._pending: deque[tuple[list[int], int, int]] = deque()  # (text, first, n-grams)
        self._pending_ngrams = 0

    def __len__(self) -> int:
        self._index_pending()
        return len(self._next)

    def add(self, prompt: list[int], output: list[int]) -> None:
        """Remember a finished request's output (and the n-grams ending in it that start in
        the prompt's last tokens) for indexing; a later occurrence of an n-gram replaces an
        earlier one."""
        if self.capacity == 0 or not output:
            return
        text = prompt[max(0, len(prompt) - (self.max_n - 1)):] + output
        first = len(text) - len(output)
        count = len(output) * (self.max_n - self.min_n + 1)  # at most this many n-grams
        self._pending.append((text, first, count))
        self._pending_ngrams += count
        while self._pending_ngrams - self._pending[0][2] >= self.capacity:
            self._pending_ngrams -= self._pending.popleft()[2]

    def _index_pending(self) -> None:
        table = self._next
        while self._pending:
            text, first, _count = self._pending.popleft()
            # n-grams ending at the prompt's last token (followed by the first output token)
            # and at each output token but the last.
            for end in range(max(first - 1, self.min_n - 1), len(text) - 1):
                for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                    key = tuple(text[end - n + 1:end + 1])
                    if key in table:
                        table.move_to_end(key)  # the newest occurrence
                    table[key] = (text, end + 1)
        self._pending_ngrams = 0
        for _ in range(len(table) - self.capacity):
            table.popitem(last=False)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed tokens' last n tokens (the largest n that is in the
        table) where they last occurred; [] when none is."""
        if self._pending:
            self._index_pending()
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            hit = self._next.get(tuple(tokens[-n:]))
            if hit is not None:
                text, at = hit
                return text[at:at + k]
        return []


@dataclass
class SpecDecodeStats:
    """Cumulative counters, vLLM's: verified proposals, their tokens, the accepted ones, and
    how often the draft at each position was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos += [0] * (num_draft_tokens - len(per_pos))
        for i in range(num_accepted):
            per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens


def spec_decode_counters(stats: SpecDecodeStats) -> dict[str, int]:
    """The heartbeat counters (common/protocol.py's names) of stats; none before the first
    verified draft, so a worker that never speculates adds nothing to its heartbeats."""
    if not stats.num_drafts:
        return {}
    counters = {"spec_decode_num_drafts": stats.num_drafts,
                "spec_decode_num_draft_tokens": stats.num_draft_tokens,
                "spec_decode_num_accepted_tokens": stats.num_accepted_tokens}
    for i, n in enumerate(stats.num_accepted_tokens_per_pos):
        counters[f"{SPEC_DECODE_PER_POS_COUNTER}{i}"] = n
    return counters
