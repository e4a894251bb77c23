"""The sampler on hand-made logits: what a user of each sampling parameter would notice."""

from __future__ import annotations

import math

import pytest
import torch

from zeroserve.worker.plan import ScheduledChunk
from zeroserve.worker.sampler import Sampler
from zeroserve.worker.sequence import SamplingParams

VOCAB = 8
EOS = 2


def chunk(params: SamplingParams, rid: str = "r", outputs=(), prompt=(1,)) -> ScheduledChunk:
    return ScheduledChunk(rid, [1], 0, [0], True, params, list(prompt), list(outputs))


def sampler(seed: int = 0) -> Sampler:
    return Sampler(VOCAB, [EOS], torch.device("cpu"), seed)


def logits_of(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


ROW = [0.0, 1.0, 3.0, 2.5, -1.0, 0.5, 2.9, 0.1]  # argmax 2 (= EOS), then 6, then 3


def draw_many(params: SamplingParams, row=ROW, n: int = 400, outputs=()) -> list[int]:
    s = sampler(1)
    batch = logits_of(*([row] * n))
    return [t.token_id for t in s.sample(batch, [chunk(params, str(i), outputs) for i in range(n)])]


def test_greedy_is_exact_argmax_per_row():
    rows = logits_of(ROW, list(reversed(ROW)), [5.0] + [0.0] * 7)
    out = sampler().sample(rows.clone(), [chunk(SamplingParams(temperature=0.0))] * 3)
    assert [t.token_id for t in out] == [2, 5, 0]


def test_greedy_takes_the_first_maximum_and_nan_as_torch_argmax_does():
    # Ties, infinities, NaN, a row with every token masked, and a wide vocabulary in a batch
    # (the CPU path is numpy's): each row's token is torch.argmax's.
    nan, inf = math.nan, math.inf
    narrow = logits_of([1.0, 3.0, 3.0, 0.0, 0, 0, 0, 0], [nan, 1.0, nan, 2.0, 0, 0, 0, 0],
                       [2.0, inf, inf, 1.0, 0, 0, 0, 0], [-inf] * 8, [0.0] * 8)
    wide = torch.randn(32, 49152, generator=torch.Generator().manual_seed(3))
    wide[5, 100] = wide[5, 200] = wide[5].max() + 1
    for rows in (narrow, wide):
        big = Sampler(rows.shape[1], [EOS], torch.device("cpu"), 0)
        out = big.sample(rows.clone(), [chunk(SamplingParams(temperature=0.0), str(i))
                                        for i in range(len(rows))])
        assert [t.token_id for t in out] == torch.argmax(rows, dim=-1).tolist()


def test_top_k_one_is_greedy_even_with_temperature():
    assert set(draw_many(SamplingParams(temperature=5.0, top_k=1))) == {2}


def test_top_k_restricts_support():
    tokens = draw_many(SamplingParams(temperature=10.0, top_k=3))
    assert set(tokens) == {2, 6, 3}


def test_top_p_restricts_support():
    # probabilities of 2, 6, 3 are about .34, .31, .21: top_p .6 keeps two of them.
    tokens = draw_many(SamplingParams(temperature=1.0, top_p=0.6))
    assert set(tokens) == {2, 6}


def test_top_p_and_top_k_mixed_with_plain_rows_in_one_batch():
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.3)]
    seen = [set() for _ in params]
    s = sampler(3)
    for _ in range(150):
        out = s.sample(logits_of(*([ROW] * 4)), [chunk(p, str(i)) for i, p in enumerate(params)])
        for i, t in enumerate(out):
            seen[i].add(t.token_id)
    assert seen[0] == {2, 6}
    assert len(seen[1]) >= 5
    assert seen[2] == {2}
    assert seen[3] == {2}


def test_min_p_drops_unlikely_tokens():
    tokens = draw_many(SamplingParams(temperature=1.0, min_p=0.5))
    assert set(tokens) == {2, 6, 3}  # p(3)/p(2) = e^-0.5 = .61 >= .5; p(1)/p(2) = e^-2 < .5


def test_temperature_sampling_follows_the_softmax():
    n = 4000
    tokens = draw_many(SamplingParams(temperature=2.0), n=n)
    probs = torch.softmax(torch.tensor(ROW) / 2.0, dim=-1)
    for token in range(VOCAB):
        expected = probs[token].item()
        observed = tokens.count(token) / n
        assert abs(observed - expected) < 4 * math.sqrt(expected * (1 - expected) / n) + 1e-3


def test_seeded_requests_repeat_whatever_shares_the_batch():
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = sampler(0).sample(logits_of(ROW), [chunk(params, "a", outputs=[5, 5])])
    others = [chunk(SamplingParams(temperature=1.0), str(i)) for i in range(5)]
    batch = logits_of(*([ROW] * 6))
    crowded = sampler(99).sample(batch, others[:3] + [chunk(params, "a", outputs=[5, 5])] + others[3:])
    assert crowded[3].token_id == alone[0].token_id
    # Different output counts give different draws: a seeded stream is not constant.
    draws = {sampler().sample(logits_of(ROW), [chunk(params, outputs=[0] * n)])[0].token_id
             for n in range(40)}
    assert len(draws) > 2


def test_unseeded_rows_differ_across_draws():
    assert len(set(draw_many(SamplingParams(temperature=1.0), n=50))) > 2


def test_repetition_penalty_discourages_seen_tokens():
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # 2 was in the prompt: 3.0 / 2 = 1.5 < 2.9 (token 6); negative logits get multiplied.
    out = sampler().sample(logits_of(ROW), [chunk(params, prompt=[2])])
    assert out[0].token_id == 6
    row = [-1.0, -0.6] + [-5.0] * 6
    out = sampler().sample(logits_of(row), [chunk(params, prompt=[0])])
    assert out[0].token_id == 1  # -1 * 2 = -2 < -0.6


def test_frequency_and_presence_penalties_count_outputs_only():
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.1)
    # token 2 appeared twice in the outputs: 3.0 - 0.2 = 2.8 < 2.9
    out = sampler().sample(logits_of(ROW), [chunk(freq, outputs=[2, 2])])
    assert out[0].token_id == 6
    out = sampler().sample(logits_of(ROW), [chunk(freq, outputs=[2], prompt=[2, 2, 2])])
    assert out[0].token_id == 2  # 3.0 - 0.1 > 2.9: prompt occurrences do not count
    pres = SamplingParams(temperature=0.0, presence_penalty=0.2)
    out = sampler().sample(logits_of(ROW), [chunk(pres, outputs=[2])])
    assert out[0].token_id == 6
    neg = SamplingParams(temperature=0.0, presence_penalty=-1.0)
    out = sampler().sample(logits_of(ROW), [chunk(neg, outputs=[4])])
    assert out[0].token_id == 2  # -1.0 + 1.0 = 0 still loses


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=5, stop_token_ids=(6,))
    out = sampler().sample(logits_of(ROW), [chunk(params, outputs=[4])])
    assert out[0].token_id == 3  # 2 (EOS) and 6 (stop id) masked
    out = sampler().sample(logits_of(ROW), [chunk(params, outputs=[4, 4])])
    assert out[0].token_id == 2
    ignoring = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=5, ignore_eos=True)
    out = sampler().sample(logits_of(ROW), [chunk(ignoring, outputs=[])])
    assert out[0].token_id == 2  # with ignore_eos, EOS is an ordinary token


def test_logprobs_come_from_the_raw_distribution():
    params = SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0)
    out = sampler().sample(logits_of(ROW), [chunk(params, prompt=[2])])[0]
    raw = torch.log_softmax(torch.tensor(ROW), dim=-1)
    assert out.token_id == 6
    assert out.logprob == pytest.approx(raw[6].item(), abs=1e-6)
    assert [t for t, _ in out.top_logprobs] == [2, 6, 3]
    assert [lp for _, lp in out.top_logprobs] == pytest.approx(raw[[2, 6, 3]].tolist(), abs=1e-6)
    zero = sampler().sample(logits_of(ROW), [chunk(SamplingParams(temperature=0.0, logprobs=0))])[0]
    assert zero.top_logprobs == [] and zero.logprob == pytest.approx(raw[2].item(), abs=1e-6)
    off = sampler().sample(logits_of(ROW), [chunk(SamplingParams(temperature=0.0))])[0]
    assert off.logprob is None and off.top_logprobs is None


def test_top_p_nucleus_larger_than_the_candidate_set_is_exact():
    from zeroserve.worker.sampler import CANDIDATES

    vocab = CANDIDATES * 3
    flat = torch.zeros(1, vocab)  # uniform: top_p 0.5 keeps half the vocabulary
    s = Sampler(vocab, [EOS], torch.device("cpu"), 0)
    params = SamplingParams(temperature=1.0, top_p=0.5)
    seen = set()
    for i in range(300):
        out = s.sample(flat.clone(), [chunk(params, outputs=[0] * i)])
        seen.add(out[0].token_id)
    assert len(seen) > 200  # far more than a candidate-only nucleus of the first tokens would
    assert max(seen) < vocab and len(seen) <= vocab // 2 + 1


def test_seeded_top_k_and_top_p_rows_repeat_whatever_shares_the_batch():
    params = SamplingParams(temperature=1.0, top_p=0.8, top_k=5, seed=42)
    alone = [sampler().sample(logits_of(ROW), [chunk(params, outputs=[0] * n)])[0].token_id
             for n in range(10)]
    plain = SamplingParams(temperature=1.0)
    crowded = []
    for n in range(10):
        batch = [chunk(plain, "x"), chunk(params, outputs=[0] * n), chunk(plain, "y")]
        crowded.append(sampler(n).sample(logits_of(ROW, ROW, ROW), batch)[1].token_id)
    assert alone == crowded


def test_top_k_at_or_above_the_vocabulary_keeps_every_token():
    from zeroserve.worker.sampler import CANDIDATES

    vocab = CANDIDATES * 3
    flat = torch.zeros(1, vocab)  # uniform over the whole vocabulary
    s = Sampler(vocab, [EOS], torch.device("cpu"), 0)
    for top_k in (vocab, vocab + 5):
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=1.0)
        seen = {s.sample(flat.clone(), [chunk(params, outputs=[0] * i)])[0].token_id
                for i in range(300)}
        # Not only the first CANDIDATES: about 2/3 of 300 uniform draws land beyond them.
        assert max(seen) >= CANDIDATES and sum(t >= CANDIDATES for t in seen) > 120


def test_a_tiny_temperature_is_greedy_not_nan():
    for temperature in (1e-300, 1e-8):
        tokens = draw_many(SamplingParams(temperature=temperature), n=20)
        assert set(tokens) == {2}  # the argmax, never a NaN draw
