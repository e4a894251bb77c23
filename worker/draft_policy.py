"""How many n-gram drafts a sequence proposes this step: its own record of how often its
drafts were right, weighed against what verifying a draft costs. Plain Python, no torch.

Verifying k drafts adds k rows to the step. A draft at position j (1-based) is worth its row
only if the step is likely to keep it: it is kept when drafts 1..j are all right, which for a
sequence whose drafts are each right with probability p is p**j. So a sequence proposes the
positions whose p**j exceeds the row's cost, i.e. j <= log(cost) / log(p), up to
`num_speculative_tokens`: drafts grow while they are accepted (p rises) and shrink after
rejections. A sequence whose estimate falls so low that not even one draft pays sits out for
a back-off (in tokens, doubling while it keeps failing, up to MAX_BACKOFF), then probes with
one draft; an accepted draft resets the back-off.

The cost of a row is relative to what the step yields. One client: a step of 1 + k rows costs
about 1 + ROW_COST * k plain steps, so a draft position pays when p**j > ROW_COST. With n
sequences decoding, the batch makes n tokens per step of cost 1 + ROW_COST * (n - 1), and k
more rows pay for the batch's throughput only if they add more than k * n * ROW_COST /
(1 + ROW_COST * (n - 1)) tokens: the bar rises with the batch (0.45 at 4, 0.62 at 8 on the
CPU), so a large batch proposes only the drafts that are nearly sure, and
`disable_by_batch_size` stops proposing altogether beyond it.

The state is per sequence and lives on this worker: a stream moved to another worker
(failover) starts there with a fresh estimate, as a new request does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# One more row in a step, as a share of a 1-row decode step. Measured on this repository's
# 2-core CPU (fp32, the default SmolLM2-135M, a 300-token context; docs/benchmarks.md
# "Adaptive n-gram speculation"): 1 + k rows cost 1.17, 1.32, 1.46, 1.59, 1.76, 1.94, 2.08
# plain steps for k = 1..7, then 2.65 at k = 8 (the block kernels pass over rows in tiles of 8:
# worker/csrc/lowbit_matmul.cpp, kTile).
# Where rows are cheaper (a GPU's decode step is bound by weight reads) it is conservative.
ROW_COST = 0.17
# Before its first verification a sequence's drafts count as right half the time (as if one
# of two had been accepted): at one client it proposes 2 drafts at first.
PRIOR_ACCEPTED = 1.0
PRIOR_JUDGED = 2.0
# Each verification's weight (the prior's too) decays by this much per later verification,
# so the estimate follows the text (a copied passage ends, a paraphrase starts) and a run of
# failures takes it to 0 within a few steps.
DECAY = 0.7
# Tokens a failing sequence sits out before it probes again: doubling from MIN to MAX.
MIN_BACKOFF = 8
MAX_BACKOFF = 128


@dataclass(slots=True)
class DraftState:
    """One sequence's record: decayed counts of accepted drafts and of drafts judged (a
    verification judges its accepted drafts plus the first rejected one, if any), and when
    it may propose again after failing."""

    num_accepted: float = PRIOR_ACCEPTED
    num_judged: float = PRIOR_JUDGED
    retry_at: int = 0  # the sequence's token count from which it may propose again
    backoff: int = MIN_BACKOFF  # the next back-off, in tokens
    is_probing: bool = False  # back from a back-off: the next proposal is one draft

    @property
    def acceptance(self) -> float:
        """The estimated probability that a draft is right, given the earlier ones were."""
        return self.num_accepted / self.num_judged


def row_cost(num_decoding: int, cost: float = ROW_COST) -> float:
    """The tokens a draft row must add, on average, to pay for itself in a step where
    num_decoding sequences decode (see the module doc)."""
    n = max(1, num_decoding)
    return min(1.0, n * cost / (1.0 + cost * (n - 1)))


def num_drafts(state: DraftState, num_tokens: int, num_decoding: int, limit: int,
               cost: float = ROW_COST) -> int:
    """How many drafts (at most limit) a sequence of num_tokens tokens should propose in a
    step where num_decoding sequences decode; 0: none this step."""
    if limit < 1 or num_tokens < state.retry_at:
        return 0
    if state.is_probing:
        return 1
    bar = row_cost(num_decoding, cost)
    p = state.acceptance
    if p <= bar:
        return 0
    if p >= 1.0:
        return limit
    return min(limit, int(math.log(bar) / math.log(p)))


def record(state: DraftState, num_proposed: int, num_accepted: int, num_tokens: int,
           num_decoding: int, cost: float = ROW_COST) -> None:
    """Learn from a verification of num_proposed drafts, num_accepted of them kept, after
    which the sequence has num_tokens tokens. A sequence whose next proposal would not pay
    backs off; an accepted draft clears the back-off."""
    state.num_accepted = DECAY * state.num_accepted + num_accepted
    state.num_judged = DECAY * state.num_judged + num_accepted + (num_accepted < num_proposed)
    state.is_probing = False
    if num_accepted:
        state.backoff = MIN_BACKOFF
    if state.acceptance <= row_cost(num_decoding, cost):
        state.retry_at = num_tokens + state.backoff
        state.backoff = min(2 * state.backoff, MAX_BACKOFF)
        state.is_probing = True
