"""Per-request sampling over a batch of logits rows.

Order of operations for each row (as vLLM does it):
  1. logprobs, when asked, come from log_softmax of the *raw* model logits (before penalties,
     temperature and truncation): vLLM's default `raw_logprobs` convention.
  2. repetition penalty (prompt and output tokens), then frequency and presence penalties
     (output tokens only).
  3. while a request has fewer than min_tokens outputs, its stop_token_ids and (unless
     ignore_eos) the model's EOS ids are masked out.
  4. greedy rows (temperature 0 or top_k 1) take the argmax: exact, no noise.
  5. the other rows: temperature, top-k, top-p, min-p, then one draw.

Draws use the exponential race (argmax of probs / E with E ~ Exp(1)), which equals sampling
from probs. A request with a seed gets its noise from a generator seeded by (seed, number of
outputs so far), so its tokens do not depend on what else is in the batch or on preemption;
rows without a seed share the runner's generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.plan import SampledToken, ScheduledChunk
from worker.sequence import SamplingParams

_MASK64 = (1 << 64) - 1


def row_seed(seed: int, num_output_tokens: int) -> int:
    """A well-mixed 63-bit seed for a request's n-th draw (splitmix64 of seed and n)."""
    z = (seed * 0x9E3779B97F4A7C15 + num_output_tokens + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device,
                 seed: int = 0):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> list[SampledToken]:
        """logits [num_rows, vocab] (fp32, one row per chunk, same order; modified in place)."""
        params = [c.params for c in chunks]
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        self._apply_penalties(logits, chunks)
        self._mask_early_stops(logits, chunks)
        token_ids = torch.argmax(logits, dim=-1)  # [num_rows]; final for greedy rows
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            picked = self._sample_random(logits[rows], [chunks[i] for i in random_rows])
            token_ids[rows] = picked
        return self._results(chunks, token_ids, raw_logprobs)

    def _apply_penalties(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> None:
        rows = [i for i, c in enumerate(chunks) if _has_penalties(c.params)]
        if not rows:
            return
        vocab = logits.shape[1]
        device = logits.device
        sub = logits[rows]  # [num_penalized, vocab] (a copy; written back below)
        counts = torch.zeros(len(rows), vocab + 1, device=device)
        in_prompt = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
        for j, i in enumerate(rows):
            outputs = chunks[i].output_token_ids
            if outputs:
                ids = torch.tensor(outputs, device=device).clamp_(0, vocab)
                counts[j].index_add_(0, ids, torch.ones(len(outputs), device=device))
            if chunks[i].prompt_token_ids:
                in_prompt[j, torch.tensor(chunks[i].prompt_token_ids, device=device).clamp_(0, vocab)] = True
        counts = counts[:, :vocab]
        in_prompt = in_prompt[:, :vocab]
        p = [chunks[i].params for i in rows]
        rep = torch.tensor([x.repetition_penalty for x in p], device=device)[:, None]
        freq = torch.tensor([x.frequency_penalty for x in p], device=device)[:, None]
        pres = torch.tensor([x.presence_penalty for x in p], device=device)[:, None]
        seen = in_prompt | (counts > 0)
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
        sub -= freq * counts + pres * (counts > 0).float()
        logits[rows] = sub

    def _mask_early_stops(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> None:
        for i, chunk in enumerate(chunks):
            p = chunk.params
            if len(chunk.output_token_ids) >= p.min_tokens:
                continue
            stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
            stops = [t for t in stops if 0 <= t < logits.shape[1]]
            if stops:
                logits[i, stops] = float("-inf")

    def _sample_random(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """logits [num_rows, vocab] of non-greedy rows -> token ids [num_rows]."""
        device = logits.device
        params = [c.params for c in chunks]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = _top_k_top_p(logits, params)
        if any(p.min_p > 0.0 for p in params):
            probs = torch.softmax(logits, dim=-1)
            min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
            threshold = min_p * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for j, chunk in enumerate(chunks):
            if chunk.params.seed is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed(row_seed(chunk.params.seed, len(chunk.output_token_ids)))
                noise[j].exponential_(generator=gen)
        return torch.argmax(probs / noise, dim=-1)

    def _results(self, chunks: Sequence[ScheduledChunk], token_ids: torch.Tensor,
                 raw_logprobs: torch.Tensor | None) -> list[SampledToken]:
        ids = token_ids.tolist()
        results = []
        for i, chunk in enumerate(chunks):
            n = chunk.params.logprobs
            if n is None or raw_logprobs is None:
                results.append(SampledToken(chunk.request_id, ids[i]))
                continue
            row = raw_logprobs[i]
            top: list[tuple[int, float]] = []
            if n > 0:
                values, indices = torch.topk(row, n)
                top = list(zip(indices.tolist(), values.tolist(), strict=True))
            results.append(SampledToken(chunk.request_id, ids[i], float(row[ids[i]]), top))
        return results


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Keep each row's top_k tokens, then the smallest prefix with mass >= top_p."""
    num_rows, vocab = logits.shape
    device = logits.device
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    # top_p 1 must keep everything, even where rounding lets the cumulative sum pass 1.
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device=device)
    # When every row has a top_k, only the top max(k) candidates can survive: skip the full sort.
    if all(0 < p.top_k for p in params):
        max_k = int(top_k.max())
        values, indices = torch.topk(logits, max_k, dim=-1)  # sorted, descending
    else:
        values, indices = torch.sort(logits, dim=-1, descending=True)
    ranks = torch.arange(values.shape[1], device=device)
    values = values.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = torch.softmax(values, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    # The first token always stays, so top_p never empties a row.
    values = values.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    out = torch.full_like(logits, float("-inf"))
    return out.scatter_(1, indices, values)
