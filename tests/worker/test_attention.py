"""Decode attention over the paged pool: the native CPU kernel and the torch path against a
plain reference that gathers each sequence's context and runs textbook softmax attention."""

from __future__ import annotations

import pytest
import torch

from zeroserve.worker import cpu_kernels
from zeroserve.worker.attention import (
    AttentionMetadata,
    PagedDecode,
    PrefillSpan,
    causal_mask,
    paged_attention,
)


@pytest.fixture(scope="module")
def kernel():
    return cpu_kernels.load(required=True).decode_attention


def reference(q, k_cache, v_cache, tables, lens, scale):
    """fp32 attention of each q row over its own context, gathered slot by slot."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    rows = []
    for i, length in enumerate(lens.tolist()):
        slots = [int(tables[i, p // block_size]) * block_size + p % block_size
                 for p in range(length)]
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)  # [L, heads, d]
        v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,lhd->hl", q[i].float(), k) * scale).softmax(-1)
        rows.append(torch.einsum("hl,lhd->hd", probs, v).flatten())
    return torch.stack(rows)


def make_problem(num_heads, num_kv_heads, head_dim, lengths, dtype, block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lengths)
    num_blocks = max_blocks * len(lengths) + 7
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    # Scattered, non-overlapping blocks; table entries past a row's length stay 0 (unused).
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lengths), max_blocks, dtype=torch.int32)
    for i, n in enumerate(lengths):
        used = -(-n // block_size)
        tables[i, :used] = order[i * max_blocks : i * max_blocks + used].to(torch.int32)
    # q as the model produces it: a view into a wider [n, heads + kv_heads, d] tensor.
    qk = torch.randn(len(lengths), num_heads + num_kv_heads, head_dim, generator=gen).to(dtype)
    q = qk[:, :num_heads]
    return q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32)


LENGTHS = [1, 2, 15, 16, 17, 33, 100, 257]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(9, 3, 64), (8, 2, 128), (4, 4, 64), (4, 2, 16), (6, 1, 32)],
)
def test_native_kernel_matches_reference(kernel, dtype, num_heads, num_kv_heads, head_dim):
    q, k_cache, v_cache, tables, lens = make_problem(num_heads, num_kv_heads, head_dim,
                                                     LENGTHS, dtype)
    scale = head_dim**-0.5
    out = kernel(q, k_cache, v_cache, tables, lens, scale)
    assert out.shape == (len(LENGTHS), num_heads * head_dim) and out.dtype == dtype
    expected = reference(q, k_cache, v_cache, tables, lens, scale)
    # fp32: summation order only. bf16: the output's own rounding (8 bits of mantissa).
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_native_kernel_with_one_thread_and_block_size_8(kernel):
    q, k_cache, v_cache, tables, lens = make_problem(9, 3, 64, LENGTHS, torch.bfloat16,
                                                     block_size=8, seed=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = kernel(q, k_cache, v_cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, tables, lens, 0.125),
                               atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_kernel_row_alone_equals_row_in_a_batch(kernel, dtype, threads):
    """A lone row's work is split by query head (too few KV-head items for the threads), a
    batch's by KV head: the split never changes a row's result, bit for bit (speculation's
    and failover's token equality rest on it)."""
    q, k_cache, v_cache, tables, lens = make_problem(9, 3, 64, LENGTHS, dtype, seed=5)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = kernel(q, k_cache, v_cache, tables, lens, 0.125)
        alone = [kernel(q[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1], 0.125)
                 for i in range(len(LENGTHS))]
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(batch, torch.cat(alone))


def test_native_kernel_rejects_bad_inputs(kernel):
    q, k_cache, v_cache, tables, lens = make_problem(9, 3, 64, [5, 9], torch.float32)
    with pytest.raises(RuntimeError, match="int32"):
        kernel(q, k_cache, v_cache, tables.long(), lens, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel(q, k_cache.bfloat16(), v_cache, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="float16"):
        kernel(q.half(), k_cache.half(), v_cache.half(), tables, lens, 0.125)


def test_paged_attention_sends_decode_rows_to_the_kernel_beside_a_prefill(kernel):
    """Decode rows go to the kernel, prefill rows to SDPA, in one call: the decode rows equal
    the kernel on its own and the prefill rows equal a torch-only call."""
    q, k_cache, v_cache, tables, lens = make_problem(9, 3, 64, [20, 40], torch.float32)
    num_prefill = 5
    prefill_q = torch.randn(num_prefill, 9, 64)
    prefill_kv = torch.randn(num_prefill, 3, 64)
    span = PrefillSpan(2, 2 + num_prefill, None, causal_mask(0, num_prefill, 3, torch.device("cpu")))
    all_q = torch.cat([q, prefill_q])
    k_new = torch.cat([torch.zeros(2, 3, 64), prefill_kv])
    v_new = torch.cat([torch.zeros(2, 3, 64), prefill_kv * 2])
    meta = AttentionMetadata(slot_mapping=None, num_decode=2, decode_groups=[], prefills=[span],
                             paged_decode=PagedDecode(kernel, tables, lens))
    out = paged_attention(all_q, k_new, v_new, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out[:2], kernel(q, k_cache, v_cache, tables, lens, 0.125))
    alone = AttentionMetadata(slot_mapping=None, num_decode=0, decode_groups=[],
                              prefills=[PrefillSpan(0, num_prefill, None, span.mask)])
    torch.testing.assert_close(
        out[2:], paged_attention(prefill_q, prefill_kv, prefill_kv * 2, k_cache, v_cache, alone,
                                 0.125))
