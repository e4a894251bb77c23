"""The adaptive draft length (worker/draft_policy.py): drafts grow while they are accepted,
shrink after rejections, a sequence whose drafts keep failing sits out a growing back-off and
then probes with one draft, and a larger batch asks more of a draft."""

from __future__ import annotations

from zeroserve.worker import draft_policy
from zeroserve.worker.draft_policy import MAX_BACKOFF, MIN_BACKOFF, DraftState, num_drafts, record

K = 7


def verify(state: DraftState, num_tokens: int, num_accepted: int | None = None,
           num_decoding: int = 1) -> tuple[int, int]:
    """Propose as the policy says at num_tokens and verify: all accepted (None) or
    num_accepted; the proposal's size and the token count after the step."""
    n = num_drafts(state, num_tokens, num_decoding, K)
    assert n > 0
    accepted = n if num_accepted is None else min(num_accepted, n)
    num_tokens += accepted + 1
    record(state, n, accepted, num_tokens, num_decoding)
    return n, num_tokens


def test_a_new_sequence_starts_with_a_short_proposal():
    assert num_drafts(DraftState(), 100, 1, K) == 2


def test_drafts_grow_to_k_while_all_are_accepted():
    state, num_tokens, sizes = DraftState(), 100, []
    for _ in range(4):
        n, num_tokens = verify(state, num_tokens)
        sizes.append(n)
    assert sizes == sorted(sizes) and sizes[0] < K and sizes[-1] == K


def test_drafts_shrink_after_rejections_and_stop_when_they_do_not_pay():
    state, num_tokens = DraftState(), 100
    for _ in range(4):
        _, num_tokens = verify(state, num_tokens)
    sizes = []
    while (n := num_drafts(state, num_tokens, 1, K)) and len(sizes) < 20:
        sizes.append(n)
        num_tokens += 1
        record(state, n, 0, num_tokens, 1)  # every first draft wrong
    assert sizes[0] == K and sizes == sorted(sizes, reverse=True) and sizes[-1] == 1
    assert len(sizes) < 10  # gave up after a few failures, not twenty
    assert num_drafts(state, num_tokens, 1, K) == 0


def test_a_failing_sequence_backs_off_longer_each_time_then_probes_with_one_draft():
    state, num_tokens = DraftState(), 100
    while num_drafts(state, num_tokens, 1, K):
        num_tokens += 1
        record(state, num_drafts(state, num_tokens - 1, 1, K), 0, num_tokens, 1)
    waits = []
    for _ in range(6):
        start = num_tokens
        while not num_drafts(state, num_tokens, 1, K):
            num_tokens += 1
        waits.append(num_tokens - start)
        assert num_drafts(state, num_tokens, 1, K) == 1  # a probe
        num_tokens += 1
        record(state, 1, 0, num_tokens, 1)
    assert waits[0] >= MIN_BACKOFF - 1 and waits == sorted(waits)
    assert waits[-1] == MAX_BACKOFF


def test_an_accepted_probe_resumes_speculation_and_resets_the_back_off():
    state, num_tokens = DraftState(), 100
    while num_drafts(state, num_tokens, 1, K):
        num_tokens += 1
        record(state, num_drafts(state, num_tokens - 1, 1, K), 0, num_tokens, 1)
    for _ in range(3):  # back off three times
        while not num_drafts(state, num_tokens, 1, K):
            num_tokens += 1
        num_tokens += 1
        record(state, 1, 0, num_tokens, 1)
    while not num_drafts(state, num_tokens, 1, K):
        num_tokens += 1
    _, num_tokens = verify(state, num_tokens)  # the probe is right
    assert state.backoff == MIN_BACKOFF
    sizes = []
    for _ in range(4):
        n, num_tokens = verify(state, num_tokens)
        sizes.append(n)
    assert sizes[-1] > 1  # proposing again, and growing


def test_a_larger_batch_asks_more_of_a_draft():
    assert draft_policy.row_cost(1) < draft_policy.row_cost(4) < draft_policy.row_cost(8) < 1
    state = DraftState(num_accepted=3.0, num_judged=5.0)  # right about two times in three
    alone, batched = num_drafts(state, 100, 1, K), num_drafts(state, 100, 8, K)
    assert alone > batched
    assert num_drafts(DraftState(num_accepted=1.0, num_judged=3.0), 100, 8, K) == 0
    assert num_drafts(DraftState(num_accepted=1.0, num_judged=3.0), 100, 1, K) >= 1


def test_the_limit_caps_every_proposal():
    sure = DraftState(num_accepted=50.0, num_judged=50.0)
    assert num_drafts(sure, 100, 1, 3) == 3
    assert num_drafts(sure, 100, 1, 0) == 0
