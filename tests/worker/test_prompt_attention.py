"""Prompt rows attend through the native kernel, one row at a time, in place in the pool
(worker/attention.py): causal by each row's context length, the same bits whether the prompt
runs whole, in chunks or after a prefix-cache hit, and no SDPA call (whose query tiles cost
7-15x more per prompt token)."""

from __future__ import annotations

import pytest
import torch

from tests.worker.arch_models import make_model, one_thread, write_gguf  # noqa: F401 - autouse
from tests.worker.test_attention import reference
from zeroserve.worker import attention, cpu_kernels
from zeroserve.worker.attention import AttentionMetadata, PagedDecode, paged_attention
from zeroserve.worker.config import EngineConfig
from zeroserve.worker.engine import Engine
from zeroserve.worker.sequence import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2)


def answers(engine: Engine, batch: list[list[int]]) -> list[list]:
    """Each prompt's greedy tokens and logprobs, the batch added at once, in order."""
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{engine.stats().num_steps}-{i}", prompt, GREEDY)
    got: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).append((out.new_token_ids, out.logprobs))
    return [got[k] for k in sorted(got)]


def tiny_engine(model, **kwargs) -> Engine:
    return Engine(EngineConfig(model=str(model), device="cpu", dtype="float32", block_size=16,
                               num_kv_blocks=128, max_model_len=256, weight_cache=False,
                               **kwargs))


def assert_chunks_and_cache_hits_answer_as_alone(model, prompts: list[list[int]],
                                                 chunk_tokens: int) -> None:
    """Prompts in chunks beside decodes, and again from the prefix cache, give each prompt's
    tokens and logprobs alone, bit for bit."""
    alone = [answers(tiny_engine(model), [p])[0] for p in prompts]
    chunked = tiny_engine(model, max_num_batched_tokens=chunk_tokens, enable_prefix_caching=True)
    assert answers(chunked, prompts) == alone
    assert [answers(chunked, [p])[0] for p in prompts] == alone  # now from the cache
    assert chunked.stats().num_prefix_hits > 0


@pytest.fixture
def no_sdpa(monkeypatch):
    """Fail any SDPA call from the attention module."""
    def refuse(*args, **kwargs):
        raise AssertionError("prompt rows went to SDPA, not the native kernel")
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", refuse)


def prompt_rows(kernel, table, start, end):
    """The runner's paged_prompt for one chunk at positions start .. end - 1."""
    return PagedDecode(kernel, torch.tensor([table], dtype=torch.int32).repeat(end - start, 1),
                       torch.arange(start + 1, end + 1, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_rows_are_causal_and_alike_in_any_chunk(no_sdpa, dtype):
    kernel = cpu_kernels.load(required=True).decode_attention
    gen = torch.Generator().manual_seed(1)
    n, block_size, heads, kv_heads, d = 150, 16, 9, 3, 64
    table = torch.randperm(40, generator=gen)[: -(-n // block_size)].tolist()
    k_cache = torch.zeros(40, block_size, kv_heads, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q = (torch.randn(n, heads, d, generator=gen) * 3).to(dtype)
    k = (torch.randn(n, kv_heads, d, generator=gen) * 3).to(dtype)
    v = torch.randn(n, kv_heads, d, generator=gen).to(dtype)
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])

    def run(start, end):
        meta = AttentionMetadata(slot_mapping=slots[start:end], num_decode=0,
                                 decode_groups=[], prefills=[],
                                 paged_prompt=prompt_rows(kernel, table, start, end))
        return paged_attention(q[start:end], k[start:end], v[start:end], k_cache, v_cache,
                               meta, 0.125)

    whole = run(0, n)
    tables = torch.tensor([table], dtype=torch.int32).repeat(n, 1)
    expected = reference(q, k_cache, v_cache, tables, torch.arange(1, n + 1), 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(whole.float(), expected, atol=tolerance, rtol=tolerance)
    for start, end in ((0, 17), (17, 64), (64, 65), (n - 1, n), (100, n)):
        assert torch.equal(run(start, end), whole[start:end]), (start, end)


def test_a_chunked_prompt_and_a_cache_hit_give_the_whole_prompts_answer_without_sdpa(
        tmp_path, no_sdpa):
    """On the engine: prompts in chunks beside decodes, and again from the prefix cache, give
    the tokens and logprobs of each prompt alone, bit for bit, and no prefill step calls SDPA."""
    model = write_gguf(make_model("llama", seed=4), tmp_path / "tiny.gguf")
    prompts = [[(i * 7 + j * 3) % 200 + 3 for i in range(n)] for j, n in enumerate((90, 33, 70))]
    assert_chunks_and_cache_hits_answer_as_alone(model, prompts, chunk_tokens=32)


def test_rows_past_the_native_positions_take_the_tiles_and_agree_in_any_chunk(
        tmp_path, monkeypatch):
    """Rows from NATIVE_PROMPT_POSITIONS on go through the SDPA tiles, earlier ones through
    the native kernel (here the boundary at 32, so the prompts cross it): prompts in chunks
    beside decodes, and again from the prefix cache, still give each prompt's answer alone,
    bit for bit, and both kernels ran."""
    from zeroserve.worker import model_runner

    monkeypatch.setattr(model_runner, "NATIVE_PROMPT_POSITIONS", 32)
    sdpa_rows = []
    real_sdpa = attention.F.scaled_dot_product_attention

    def counting_sdpa(q, *args, **kwargs):
        sdpa_rows.append(q.shape[-2])
        return real_sdpa(q, *args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counting_sdpa)
    model = write_gguf(make_model("llama", seed=4), tmp_path / "tiny.gguf")
    prompts = [[(i * 5 + j * 11) % 200 + 3 for i in range(n)] for j, n in enumerate((90, 20, 70))]
    # Chunks of 24 start before, at and after position 32.
    assert_chunks_and_cache_hits_answer_as_alone(model, prompts, chunk_tokens=24)
    assert sdpa_rows  # the rows past 32 took the tiles


def test_the_torch_paths_query_tiles_take_keys_only_up_to_their_own_end(monkeypatch):
    """Where prompt rows go to SDPA (the torch backend, other devices, sliding windows), a
    32-row tile at positions a .. a + 31 computes against keys 0 .. a + 31 only (causal), not
    the whole context, and a row still comes out alike whole or in a chunk."""
    from zeroserve.worker.attention import PrefillSpan, _prefill_attention, causal_mask

    real = attention.F.scaled_dot_product_attention
    key_counts: list[int] = []

    def counting(q, k, v, **kwargs):
        key_counts.append(k.shape[2])
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counting)
    gen = torch.Generator().manual_seed(2)
    n, heads, kv_heads, d = 100, 9, 3, 64
    q = torch.randn(n, heads, d, generator=gen)
    k = torch.randn(n, kv_heads, d, generator=gen)
    v = torch.randn(n, kv_heads, d, generator=gen)
    cpu = torch.device("cpu")
    whole = _prefill_attention(q, k, v, None, None,
                               PrefillSpan(0, n, None, causal_mask(0, n, 3, cpu)), 0.125)
    assert key_counts == [32, 64, 96, 128]
    key_counts.clear()
    pool_k, pool_v = k.view(n, 1, kv_heads, d), v.view(n, 1, kv_heads, d)
    part = _prefill_attention(q[40:70], k[40:70], v[40:70], pool_k, pool_v,
                              PrefillSpan(0, 30, torch.arange(70), causal_mask(40, 30, 3, cpu)),
                              0.125)
    assert key_counts == [64, 96]  # the tiles at 32 and 64
    assert torch.equal(part, whole[40:70])
