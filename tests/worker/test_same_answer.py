"""The same request gets the same tokens and logprobs, bit for bit, whatever shares its steps
and however much of its prompt the prefix cache held (docs/architecture.md, "Batch
independence").

Each prompt runs alone on an engine without prefix caching (the reference), then all together
in steps too small for them (chunked prefill beside other prompts and decodes), then again
after the others on an engine whose prefix cache holds their blocks: a prompt that shares its
first block with a shorter one finds that block cached, computed by the other prompt. Greedy
at temperature 0 with logprobs; prompt lengths cross the low-bit kernels' position limit (64)
and leave one to fifteen tokens after a cache hit. On a native-bf16 CPU the bfloat16 path
once answered 6 of 8 chat prompts the same when each was sent twice (issue 35).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.worker.arch_models import (
    make_model,
    one_thread,  # noqa: F401 - autouse
    quantize_like_file,
    write_gguf,
)
from tests.worker.test_quantizations import MIXES, WIDE
from zeroserve.worker.config import EngineConfig
from zeroserve.worker.engine import Engine
from zeroserve.worker.model.quant import int4_kernels_available
from zeroserve.worker.sequence import SamplingParams

_rng = random.Random(5)
_SHARED = [_rng.randrange(3, 250) for _ in range(16)]  # one block that several prompts share
LENGTHS = [33, 50, 85, 121, 17, 70, 65]
PROMPTS = [(_SHARED if i % 2 == 0 else [])
           + [_rng.randrange(3, 250) for _ in range(n - (16 if i % 2 == 0 else 0))]
           for i, n in enumerate(LENGTHS)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory):
    model = make_model("llama", seed=3, tie_word_embeddings=False, **WIDE)
    return write_gguf(model, tmp_path_factory.mktemp("same") / "tiny.gguf",
                      quantize_like_file(model, MIXES["Q4_K"]))


def run(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    """Each prompt's tokens and logprob entries, in order."""
    base = engine.stats().num_steps
    ids = [f"p{base}-{i}" for i in range(len(prompts))]
    results: dict[str, tuple[list[int], list]] = {i: ([], []) for i in ids}
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, GREEDY)
    while engine.has_unfinished():
        for out in engine.step():
            tokens, logprobs = results[out.request_id]
            tokens += out.new_token_ids
            logprobs += out.logprobs or []
    return [results[i] for i in ids]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "auto", "float32+int8", "auto+int8"])
def test_a_request_gets_the_same_answer_alone_in_a_batch_and_from_the_prefix_cache(
        q4_model, dtype):
    """float32+int8: decode rows with int8 activations (--int8-activations). auto: on a CPU
    with native bf16, fp32 with the prompt rows' projections in bf16."""
    if dtype == "bfloat16" and not int4_kernels_available():
        pytest.skip("torch has no int4 weight kernel here")
    dtype, _, int8 = dtype.partition("+")

    def engine(prefix_caching: bool) -> Engine:
        return Engine(EngineConfig(model=str(q4_model), device="cpu", dtype=dtype,
                                   block_size=16, num_kv_blocks=256, max_model_len=512,
                                   max_num_batched_tokens=64, weight_cache=False,
                                   enable_prefix_caching=prefix_caching,
                                   int8_activations=bool(int8)))

    cold = engine(prefix_caching=False)
    alone = [run(cold, [p])[0] for p in PROMPTS]
    assert run(cold, PROMPTS) == alone  # together, in chunks, beside decodes
    cached = engine(prefix_caching=True)
    assert run(cached, PROMPTS) == alone  # the shared block computed by whichever came first
    for prompt, expected in zip(PROMPTS, alone, strict=True):
        assert run(cached, [prompt]) == [expected]  # all but the last 1-15 tokens cached
    assert cached.stats().num_prefix_hits > 0


@pytest.mark.parametrize("dtype", ["float32", "auto+int8"])
def test_a_moved_request_goes_on_with_the_undisturbed_tokens_and_logprobs(q4_model, dtype):
    """A stream that moved here (failover, drain) brings the tokens it produced; this worker
    computes them again, as the decode rows that first computed them, so what follows is bit
    for bit the undisturbed run's, logprobs too: also where they cross a block's end and share
    a chunk with the prompt's last tokens, and beside other requests' chunks."""
    dtype, _, int8 = dtype.partition("+")
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)

    def engine() -> Engine:
        return Engine(EngineConfig(model=str(q4_model), device="cpu", dtype=dtype,
                                   block_size=16, num_kv_blocks=256, max_model_len=512,
                                   max_num_batched_tokens=64, weight_cache=False,
                                   enable_prefix_caching=False, int8_activations=bool(int8)))

    def outputs(eng: Engine, requests: dict[str, tuple[list[int], list[int]]]) -> dict:
        got: dict[str, tuple[list[int], list]] = {rid: ([], []) for rid in requests}
        for rid, (prompt, produced) in requests.items():
            eng.add_request(rid, prompt, params, output_token_ids=produced)
        while eng.has_unfinished():
            for out in eng.step():
                got[out.request_id][0].extend(out.new_token_ids)
                got[out.request_id][1].extend(out.logprobs or [])
        return got

    eng = engine()
    prompts = {f"p{i}": (PROMPTS[i], []) for i in (0, 1, 3)}
    alone = outputs(eng, prompts)
    for moved_after in (1, 5, 17):  # the produced tokens end inside, at and past a block
        moved = {rid: (prompt, alone[rid][0][:moved_after]) for rid, (prompt, _) in
                 prompts.items()}
        beside = {"other": (PROMPTS[2], [])}
        got = outputs(eng, {**{f"{rid}-{moved_after}": r for rid, r in moved.items()}, **beside})
        for rid in prompts:
            tokens, logprobs = got[f"{rid}-{moved_after}"]
            assert tokens == alone[rid][0][moved_after:], (rid, moved_after)
            assert logprobs == alone[rid][1][moved_after:], (rid, moved_after)


def test_prefill_attention_computes_a_row_alike_in_any_chunk():
    """A chunk's rows come out of prefill attention as within the whole prompt, whatever the
    chunk's start and length (the kernel's blocks follow its query and key counts)."""
    from zeroserve.worker.attention import PrefillSpan, _prefill_attention, causal_mask

    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim = 9, 3, 64
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        for n in (33, 85, 140, 300):
            q = (torch.randn(n, heads, head_dim, generator=generator) * 3).to(dtype)
            k = (torch.randn(n, kv_heads, head_dim, generator=generator) * 3).to(dtype)
            v = torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype)
            pool_k, pool_v = k.view(n, 1, kv_heads, head_dim), v.view(n, 1, kv_heads, head_dim)
            whole = _prefill_attention(q, k, v, None, None, PrefillSpan(
                0, n, None, causal_mask(0, n, heads // kv_heads, cpu)), 0.125)
            for start, end in ((n - 1, n), (n - 2, n), (16, n), (n // 2, n), (0, n // 2),
                               (5, n - 7)):
                part = _prefill_attention(q[start:end], k[start:end], v[start:end], pool_k,
                                          pool_v, PrefillSpan(
                                              0, end - start, torch.arange(end),
                                              causal_mask(start, end - start,
                                                          heads // kv_heads, cpu)), 0.125)
                assert torch.equal(part, whole[start:end]), (dtype, n, start, end)


def test_low_bit_rows_follow_positions_not_the_step():
    from zeroserve.worker.model_runner import _low_bit_rows
    from zeroserve.worker.plan import ScheduledChunk

    def chunk(start: int, n: int) -> ScheduledChunk:
        return ScheduledChunk("r", list(range(n)), start, [], False, GREEDY)

    # Decodes, then chunks by start: positions below 64 take the low-bit kernels.
    assert _low_bit_rows(3, [chunk(0, 20), chunk(64, 30)], 64) == 23
    assert _low_bit_rows(2, [chunk(0, 10), chunk(60, 8)], 64) == 16  # 60..63, a prefix
    low, dense = _low_bit_rows(1, [chunk(0, 70), chunk(0, 5)], 64)
    assert low.tolist() == [*range(65), *range(71, 76)]
    assert dense.tolist() == list(range(65, 71))
    assert _low_bit_rows(0, [chunk(100, 40)], 64) == 0
