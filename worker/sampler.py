"""Per-request sampling over a batch of logits rows.

Order of operations for each row (as vLLM does it):
  1. logprobs, when asked, come from log_softmax of the *raw* model logits (before penalties,
     temperature and truncation): vLLM's default `raw_logprobs` convention.
  2. repetition penalty (prompt and output tokens), then frequency and presence penalties
     (output tokens only).
  3. logit_bias (OpenAI's: added to the logits of the given token ids).
  4. while a request has fewer than min_tokens outputs, its stop_token_ids and (unless
     ignore_eos) the model's EOS ids are masked out.
  5. a request with a grammar (worker/grammar.py) keeps only the tokens its grammar allows
     next; on an accelerator the masks are computed by llguidance on a helper thread,
     started by `prepare()` before the forward so that they are ready when the logits are;
     on the CPU (whose cores the forward already uses) right after the forward.
  6. greedy rows (temperature 0 or top_k 1) take the argmax: exact, no noise.
  7. the other rows: temperature, min-p, top-k, top-p (vLLM v1's order), then one draw.

A draw is one uniform number per row pushed through the row's cumulative distribution (no
per-token noise, so a batch of 32 costs a cumsum, not 1.5M random numbers). A request with a
seed takes its uniform from a generator seeded by (seed, number of outputs so far), so its
tokens do not depend on what else is in the batch or on preemption; rows without a seed share
the runner's generator (seeded from EngineConfig.seed). The uniforms are drawn on the CPU
and copied to the logits' device in one transfer: CPU and CUDA generators give different
streams for one seed, and a seeded request should draw the same numbers on either device.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from zeroserve.worker.grammar import GrammarState
from zeroserve.worker.plan import SampledToken, ScheduledChunk
from zeroserve.worker.sequence import SamplingParams

_MASK64 = (1 << 64) - 1


def row_seed(seed: int, num_output_tokens: int) -> int:
    """A well-mixed 63-bit seed for a request's n-th draw (splitmix64 of seed and n)."""
    z = (seed * 0x9E3779B97F4A7C15 + num_output_tokens + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [num_rows] (int64): the first maximum, NaN counting as the largest,
    as torch.argmax. On the CPU numpy's, on the calling thread: torch's shares 16-32 rows of
    a 49,152 vocabulary between the intra-op threads, a parallel region for about 50 us of
    vectorized work, which took 0.6 ms of CPU per decode step on a quiet machine and 3-4 ms
    on a loaded one (2 threads), against numpy's 0.05-0.1 ms."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return torch.argmax(logits, dim=-1)
    return torch.from_numpy(np.argmax(logits.numpy(), axis=1))


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device,
                 seed: int = 0):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.generator = torch.Generator()  # on the CPU, whatever the device (module doc)
        self.generator.manual_seed(seed)
        # Masks overlap the forward only where it leaves the CPU free (an accelerator); on
        # the CPU the forward's threads use every core, and a mask thread beside them slowed
        # the forward more than the masks cost after it.
        self._grammar_masks = GrammarMasks(overlap=device.type != "cpu")

    def prepare(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Start computing this step's grammar masks (call before the forward, with the
        chunks that `sample` will get)."""
        self._grammar_masks.start(chunks, self.vocab_size)

    def sample(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> list[SampledToken]:
        """logits [num_rows, vocab] (fp32, one row per chunk, same order; modified in place)."""
        params = [c.params for c in chunks]
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        self._apply_penalties(logits, chunks)
        _apply_logit_bias(logits, chunks)
        self._mask_early_stops(logits, chunks)
        self._grammar_masks.apply(logits, chunks, self.eos_token_ids)
        token_ids = _argmax_rows(logits)  # [num_rows]; final for greedy rows
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            picked = self._sample_random(logits[rows], [chunks[i] for i in random_rows])
            token_ids[rows] = picked
        return self._results(chunks, token_ids, raw_logprobs)

    def prompt_logprobs(self, compute_logits, hidden: torch.Tensor,
                        prompt_rows: list[tuple[ScheduledChunk, int]]
                        ) -> dict[str, tuple[int, list]]:
        """For chunks of requests with params.prompt_logprobs: the logprob of each prompt
        token the chunk's rows predict (position p's row predicts token p + 1), with the
        top-N alternatives, from the raw logits. hidden [num_tokens, hidden]; returns request
        id -> (first predicted position, [(logprob, [(id, logprob), ...]), ...])."""
        out: dict[str, tuple[int, list]] = {}
        for chunk, first_row in prompt_rows:
            prompt = chunk.prompt_token_ids
            # Rows whose next token is a prompt token (the last prompt row predicts an output).
            num_rows = min(chunk.context_len, len(prompt) - 1) - chunk.start_pos
            entries: list = []
            for start in range(0, max(num_rows, 0), PROMPT_LOGPROB_ROWS):  # bounded memory
                end = min(start + PROMPT_LOGPROB_ROWS, num_rows)
                rows = hidden[first_row + start:first_row + end]
                logprobs = torch.log_softmax(compute_logits(rows).float(), dim=-1)
                pos = chunk.start_pos + start
                targets = torch.tensor(prompt[pos + 1:pos + 1 + end - start],
                                       device=logprobs.device)
                chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
                k = chunk.params.prompt_logprobs
                if k:
                    values, indices = torch.topk(logprobs, k, dim=-1)
                    tops = [list(zip(i, v, strict=True)) for i, v in
                            zip(indices.tolist(), values.tolist(), strict=True)]
                else:
                    tops = [[] for _ in chosen]
                entries += list(zip(chosen, tops, strict=True))
            if entries:
                out[chunk.request_id] = (chunk.start_pos + 1, entries)
        return out

    def _apply_penalties(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> None:
        rows = [i for i, c in enumerate(chunks) if _has_penalties(c.params)]
        if not rows:
            return
        vocab = logits.shape[1]
        device = logits.device
        sub = logits[rows]  # [num_penalized, vocab] (a copy; written back below)
        counts = torch.zeros(len(rows), vocab, device=device)
        in_prompt = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
        # One scatter for all rows: (row, token) pairs flattened. Out-of-vocabulary ids
        # cannot occur (the engine validates prompts; outputs come from this vocabulary).
        out_rows = [j for j, i in enumerate(rows) for _ in chunks[i].output_token_ids]
        if out_rows:
            out_ids = [t for i in rows for t in chunks[i].output_token_ids]
            counts.index_put_(
                (torch.tensor(out_rows, device=device), torch.tensor(out_ids, device=device)),
                torch.ones(len(out_ids), device=device), accumulate=True,
            )
        prompt_rows = [j for j, i in enumerate(rows) for _ in chunks[i].prompt_token_ids]
        if prompt_rows:
            prompt_ids = [t for i in rows for t in chunks[i].prompt_token_ids]
            in_prompt[torch.tensor(prompt_rows, device=device),
                      torch.tensor(prompt_ids, device=device)] = True
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
            if len(chunk.output_token_ids) >= p.min_tokens or p.grammar is not None:
                continue  # a grammar decides by itself where the output may end
            stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
            stops = [t for t in stops if 0 <= t < logits.shape[1]]
            if stops:
                logits[i, stops] = float("-inf")

    def _sample_random(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """logits [num_rows, vocab] of non-greedy rows -> token ids [num_rows]."""
        device = logits.device
        params = [c.params for c in chunks]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        logits = logits.div_(temperature[:, None])
        if any(p.min_p > 0.0 for p in params):
            # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); min_p 0 masks nothing.
            log_min_p = torch.tensor([p.min_p for p in params], device=device).log()
            floor = logits.amax(dim=-1) + log_min_p
            logits.masked_fill_(logits < floor[:, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # [num_rows, vocab]
        uniform = self._uniforms(chunks, device)  # [num_rows]
        token_ids = _inverse_cdf(probs, uniform)
        # top_k at or above the vocabulary truncates nothing: such a row is a plain draw
        # (not one among the top CANDIDATES).
        vocab = probs.shape[1]
        truncated = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
        if truncated:
            rows = torch.tensor(truncated, device=device)
            token_ids[rows] = _sample_truncated(probs[rows], uniform[rows],
                                                [params[i] for i in truncated])
        return token_ids

    def _uniforms(self, chunks: list[ScheduledChunk], device: torch.device) -> torch.Tensor:
        """One U[0, 1) per row: the shared generator, or the request's own (seed, n); drawn
        on the CPU, then one copy to `device`."""
        uniform = torch.rand(len(chunks), generator=self.generator)
        for j, chunk in enumerate(chunks):
            if chunk.params.seed is not None:
                gen = torch.Generator()
                gen.manual_seed(row_seed(chunk.params.seed, len(chunk.output_token_ids)))
                uniform[j] = torch.rand(1, generator=gen)[0]
        return uniform.to(device)

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


def _apply_logit_bias(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> None:
    rows, ids, biases = [], [], []
    vocab = logits.shape[1]
    for i, chunk in enumerate(chunks):
        for token_id, bias in chunk.params.logit_bias:
            if 0 <= token_id < vocab:
                rows.append(i)
                ids.append(token_id)
                biases.append(bias)
    if rows:
        device = logits.device
        logits.index_put_((torch.tensor(rows, device=device), torch.tensor(ids, device=device)),
                          torch.tensor(biases, dtype=logits.dtype, device=device),
                          accumulate=True)


class GrammarMasks:
    """The allowed-token masks of a step's constrained rows.

    Computing them syncs each constrained sequence's matcher with its output tokens and has
    llguidance fill one bitmask row per sequence (32 tokens per int32). With `overlap`,
    `start` does that on a helper thread while the model runs; `apply` waits for it (or
    computes the masks itself: without overlap, or if `start` saw other chunks) and sets
    every token the grammar forbids to -inf. A matcher that failed, or whose grammar is complete, allows
    only the EOS ids, so the sequence ends. Rows without a grammar cost nothing.
    """

    def __init__(self, overlap: bool = True) -> None:
        self.overlap = overlap
        self._pool: ThreadPoolExecutor | None = None
        self._executor = None  # llguidance.LLExecutor, created with the first grammar
        self._pending: tuple[list, Future] | None = None  # (chunks, future of the masks)

    def start(self, chunks: Sequence[ScheduledChunk], vocab_size: int) -> None:
        self._pending = None
        if not self.overlap or not any(c.params.grammar is not None for c in chunks):
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        chunks = list(chunks)
        self._pending = (chunks, self._pool.submit(self._compute, chunks, vocab_size))

    def apply(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk],
              eos_token_ids: tuple[int, ...]) -> None:
        pending, self._pending = self._pending, None
        if not any(c.params.grammar is not None for c in chunks):
            return
        if pending is not None and len(pending[0]) == len(chunks) and all(
                a is b for a, b in zip(pending[0], chunks, strict=True)):
            rows, bitmask, done = pending[1].result()
        else:
            rows, bitmask, done = self._compute(list(chunks), logits.shape[1])
        vocab = logits.shape[1]
        # numpy, single-threaded: microseconds, where torch's threaded bit ops on a loaded
        # machine took milliseconds. Bit k of word w is token 32 w + k (little endian).
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab,
                                bitorder="little").view(np.bool_)  # [num_rows, vocab]
        eos = [t for t in eos_token_ids if 0 <= t < vocab]
        for j in range(len(rows)):
            if done[j] or not allowed[j].any():
                allowed[j] = False
                allowed[j, eos] = True
        if (logits.device.type == "cpu" and logits.is_contiguous()
                and logits.dtype in (torch.float32, torch.float64)):
            values = logits.numpy()  # shares memory; numpy's where-copy is single-threaded
            for j, i in enumerate(rows):
                np.copyto(values[i], -np.inf, where=~allowed[j])
            return
        forbidden = torch.from_numpy(~allowed).to(logits.device)
        if len(rows) == len(chunks):
            logits.masked_fill_(forbidden, float("-inf"))
            return
        index = torch.tensor(rows, device=logits.device)
        sub = logits[index]
        sub.masked_fill_(forbidden, float("-inf"))
        logits[index] = sub

    def _compute(self, chunks: list[ScheduledChunk], vocab_size: int
                 ) -> tuple[list[int], np.ndarray, list[bool]]:
        """Rows of the constrained chunks, their bitmasks [rows, ceil(vocab / 32)], and
        whether each row's grammar was done (allows only EOS).

        A drafted chunk's rows (worker/verify.py) share one state, each row's outputs one
        draft longer: their masks are computed one after the other, each right after its
        sync, since the next row's sync advances the same matcher."""
        import llguidance

        rows = [i for i, c in enumerate(chunks) if c.params.grammar is not None]
        words = (vocab_size + 31) // 32
        bitmask = np.zeros((len(rows), words), dtype=np.int32)
        done = [False] * len(rows)
        live = []
        states = [chunks[i].params.grammar for i in rows]
        shared = {id(s) for k, s in enumerate(states) if k and states[k - 1] is s}
        for j, i in enumerate(rows):
            state: GrammarState = states[j]
            state.sync(chunks[i].output_token_ids)
            done[j] = state.is_done
            if done[j]:
                continue
            if id(state) in shared:
                state.matcher.unsafe_compute_mask_ptr(bitmask[j].ctypes.data, words * 4)
            else:
                live.append((state.matcher, j))
        if live and not self.overlap:
            # On the calling thread, one matcher after the other: on the CPU a pool of
            # llguidance threads would still be spinning when the next forward starts.
            for matcher, j in live:
                matcher.unsafe_compute_mask_ptr(bitmask[j].ctypes.data, words * 4)
        elif live:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(live, bitmask.ctypes.data, words * 4,
                                                   len(rows))
        return rows, bitmask, done


# Prompt logprobs are computed this many rows at a time ([rows, vocab] floats each).
PROMPT_LOGPROB_ROWS = 256

# top-k / top-p look for their tokens among the most likely CANDIDATES first (a partial
# top-k is far cheaper than sorting the vocabulary); a top-p row whose nucleus is larger
# than that falls back to a full sort.
CANDIDATES = 1024


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Sample one index per row of probs [rows, n] (rows need not sum to 1)."""
    cdf = torch.cumsum(probs, dim=-1)
    target = (uniform * cdf[:, -1])[:, None]
    # The first index whose cdf exceeds the target; zero-probability entries never qualify.
    index = torch.searchsorted(cdf, target, right=True)[:, 0]
    return index.clamp_(max=probs.shape[1] - 1)


def _sample_truncated(probs: torch.Tensor, uniform: torch.Tensor,
                      params: list[SamplingParams]) -> torch.Tensor:
    """Rows with top_k and/or top_p: order each row's tokens by probability, ties by token id,
    keep the first top_k, then the smallest prefix whose mass reaches top_p (the first token
    always stays), and sample among them.

    The tie order is fixed so that a row's token never depends on the rest of the batch
    (bf16 logits tie often; topk's order among equal values varies with k and with the
    batch). A row is worked out among its candidates where every token it keeps is strictly
    more likely than the last candidate (then all tokens that likely are candidates, in the
    full order); otherwise its whole vocabulary is sorted."""
    vocab = probs.shape[1]
    device = probs.device
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                         device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    # One more than the largest top_k, so that a top_k row is exact unless a tie straddles it.
    num_candidates = min(vocab, max(k if k < vocab else CANDIDATES for k in top_k.tolist()) + 1)
    values, indices = torch.topk(probs, num_candidates, dim=-1)
    by_id = indices.argsort(dim=-1)
    values, order = torch.sort(values.gather(1, by_id), dim=-1, descending=True, stable=True)
    indices = indices.gather(1, by_id).gather(1, order)
    keep = _kept(values, probs, top_k, top_p)
    token_ids = indices.gather(1, _inverse_cdf(values * keep, uniform)[:, None])[:, 0]
    if num_candidates < vocab:
        # Zero-probability tokens are never drawn, so ties among them do not matter.
        inexact = (keep & (values <= values[:, -1:]) & (values > 0)).any(dim=-1)
        rows = inexact.nonzero()[:, 0]
        if len(rows):
            values, indices = torch.sort(probs[rows], dim=-1, descending=True, stable=True)
            keep = _kept(values, probs[rows], top_k[rows], top_p[rows])
            picked = _inverse_cdf(values * keep, uniform[rows])
            token_ids[rows] = indices.gather(1, picked[:, None])[:, 0]
    return token_ids


def _kept(values: torch.Tensor, probs: torch.Tensor, top_k: torch.Tensor,
          top_p: torch.Tensor) -> torch.Tensor:
    """[rows, n] True for the tokens a row keeps, of its n most likely (`values`, sorted)."""
    ranks = torch.arange(values.shape[1], device=values.device)
    keep = ranks[None, :] < top_k[:, None]
    total = probs.sum(dim=-1, keepdim=True)
    mass_before = (torch.cumsum(values, dim=-1) - values) / total
    # top_p 1 keeps everything, even where rounding lets the cumulative sum pass 1.
    return keep & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
