"""The acceptance rule of speculative decoding (worker/verify.py) as the sampler applies it:
on a small vocabulary with many samples, the tokens that come out with drafts follow the
target's processed distribution (temperature, top-k, penalties as the sampler applies
them); a draft d is accepted with probability p(d), and a rejection samples from p without d,
renormalized. Tolerance: a total variation distance of at most 4x the sampling noise's
bound, 0.5 sqrt(2 V / (pi n)) for n samples over V tokens: 0.039 for 10,000 samples."""

from __future__ import annotations

import math

import torch

from zeroserve.worker import verify
from zeroserve.worker.plan import ScheduledChunk
from zeroserve.worker.sampler import Sampler
from zeroserve.worker.sequence import SamplingParams

VOCAB = 6
NUM_SAMPLES = 10_000


def tolerance(num_samples: int) -> float:
    return 4 * 0.5 * math.sqrt(2 * VOCAB / (math.pi * num_samples))


TOLERANCE = tolerance(NUM_SAMPLES)
LOGITS = torch.tensor([[1.0, 2.0, 0.5, 1.5, -1.0, 0.0],   # row 0: after the context
                       [0.2, 0.1, 1.8, 0.0, 1.0, -0.5]])  # row 1: after draft 0


def drafted_chunks(params: list[SamplingParams], drafts: list[int]) -> list[ScheduledChunk]:
    return [ScheduledChunk(f"r{i}", [5, *drafts], 10, [0, 1, 2, 3], True, p, [1, 2, 3],
                           [4, 5], draft_token_ids=list(drafts))
            for i, p in enumerate(params)]


def run(params: list[SamplingParams], drafts: list[int], logits: torch.Tensor):
    chunks = drafted_chunks(params, drafts)
    rows, counts = verify.expand(chunks)
    sampler = Sampler(VOCAB, eos_token_ids=(), device=torch.device("cpu"), seed=3)
    per_row = sampler.sample(logits[:len(drafts) + 1].repeat(len(chunks), 1), rows)
    return verify.accept(chunks, counts, per_row)


def histogram(tokens: list[int]) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=VOCAB).float()
    return counts / counts.sum()


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def target(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
           penalized: tuple[int, ...] = (), penalty: float = 1.0) -> torch.Tensor:
    row = logits.clone()
    for t in penalized:
        row[t] = row[t] / penalty if row[t] > 0 else row[t] * penalty
    p = torch.softmax(row / temperature, dim=-1)
    if top_k:
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[torch.topk(p, top_k).indices] = True
        p = torch.where(keep, p, torch.zeros(()))
    return p / p.sum()


def first_tokens(results) -> list[int]:
    return [(s.accepted_token_ids or [s.token_id])[0] for s in results]


def test_output_distribution_is_the_targets_accept_rate_is_p_of_the_draft():
    p = target(LOGITS[0])
    for draft in (1, 4):  # a likely and an unlikely guess
        results = run([SamplingParams(temperature=1.0, max_tokens=8)] * NUM_SAMPLES,
                      [draft], LOGITS)
        assert tv(histogram(first_tokens(results)), p) < TOLERANCE
        accepted = [s for s in results if s.accepted_token_ids]
        assert abs(len(accepted) / NUM_SAMPLES - float(p[draft])) < TOLERANCE
        # On rejection: p without the draft, renormalized.
        rejected = [s.token_id for s in results if not s.accepted_token_ids]
        residual = p.clone()
        residual[draft] = 0
        assert draft not in rejected
        assert tv(histogram(rejected), residual / residual.sum()) < tolerance(len(rejected))
        # After an accepted draft, the bonus token follows row 1's distribution.
        assert tv(histogram([s.token_id for s in accepted]), target(LOGITS[1])) < tolerance(
            len(accepted))


def test_processed_distribution_with_temperature_top_k_and_penalties():
    params = SamplingParams(temperature=0.7, top_k=4, repetition_penalty=1.5, max_tokens=8)
    # The context holds tokens 1..5 (prompt [1, 2, 3], outputs [4, 5]): all penalized.
    p = target(LOGITS[0], 0.7, 4, penalized=(1, 2, 3, 4, 5), penalty=1.5)
    results = run([params] * NUM_SAMPLES, [3], LOGITS)
    assert tv(histogram(first_tokens(results)), p) < TOLERANCE
    assert abs(sum(bool(s.accepted_token_ids) for s in results) / NUM_SAMPLES
               - float(p[3])) < TOLERANCE


def test_seeded_rows_follow_the_target_and_match_plain_decoding():
    num = 3_000  # a generator per seeded row: fewer samples, a wider tolerance
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=8) for s in range(num)]
    results = run(params, [1], LOGITS)
    assert tv(histogram(first_tokens(results)), target(LOGITS[0])) < tolerance(num)
    # Each seeded request's first token is the one plain decoding draws at that position.
    chunks = [ScheduledChunk(f"r{i}", [5], 10, [0], True, p, [1, 2, 3], [4, 5])
              for i, p in enumerate(params[:500])]
    sampler = Sampler(VOCAB, eos_token_ids=(), device=torch.device("cpu"))
    plain = sampler.sample(LOGITS[:1].repeat(500, 1), chunks)
    assert first_tokens(results[:500]) == [s.token_id for s in plain]
