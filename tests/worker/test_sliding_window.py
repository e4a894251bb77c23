"""Sliding-window attention over the paged cache, against attention computed directly from
each sequence's keys: decode rows in torch groups and in the native kernel's metadata (which
the window turns into a torch group), and a prefill chunk that continues a cached context."""

from __future__ import annotations

import math

import torch

from zeroserve.worker.attention import (
    AttentionMetadata,
    DecodeGroup,
    PagedDecode,
    PrefillSpan,
    causal_mask,
    paged_attention,
)
from zeroserve.worker.model.sliding_window import windowed

BLOCK, KV_HEADS, HEADS, DIM, WINDOW = 4, 2, 4, 8, 5


def reference(q, k, v, query_pos, window):
    """q [heads, d] at query_pos over k/v [L, kv_heads, d] of positions 0..L-1."""
    keys = [p for p in range(k.shape[0]) if query_pos - window < p <= query_pos]
    group = HEADS // KV_HEADS
    out = []
    for h in range(HEADS):
        kh, vh = k[keys, h // group], v[keys, h // group]
        probs = torch.softmax(kh @ q[h] / math.sqrt(DIM), dim=0)
        out.append(probs @ vh)
    return torch.cat(out)


def pool_with(contexts: list[int]):
    """A pool holding random K/V for sequences of these lengths, in shuffled blocks."""
    torch.manual_seed(0)
    num_blocks = sum(math.ceil(n / BLOCK) for n in contexts) + 3
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM)
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(math.ceil(n / BLOCK))] for n in contexts]
    return k_cache, v_cache, tables


def seq_kv(cache, table, length):
    return cache[table].reshape(-1, KV_HEADS, DIM)[:length]


def test_decode_rows_torch_group_and_native_metadata():
    contexts = [3, 9, 14]
    k_cache, v_cache, tables = pool_with(contexts)
    q = torch.randn(len(contexts), HEADS, DIM)
    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    max_context = max_blocks * BLOCK
    bias = torch.zeros(len(contexts), 1, max_context)
    for row, n in enumerate(contexts):
        bias[row, 0, n:] = float("-inf")
    group = DecodeGroup(0, len(contexts), torch.tensor(padded).flatten(), bias, max_context)

    def never(*args):
        raise AssertionError("the native kernel has no window")

    native = PagedDecode(never, torch.tensor(padded, dtype=torch.int32),
                         torch.tensor(contexts, dtype=torch.int32))
    for meta in (AttentionMetadata(None, len(contexts), [group], []),
                 AttentionMetadata(None, len(contexts), [], [], paged_decode=native)):
        out = paged_attention(q, None, None, k_cache, v_cache,
                              windowed(meta, WINDOW, BLOCK, torch.float32), DIM**-0.5)
        for row, n in enumerate(contexts):
            expected = reference(q[row], seq_kv(k_cache, tables[row], n),
                                 seq_kv(v_cache, tables[row], n), n - 1, WINDOW)
            torch.testing.assert_close(out[row], expected)


def test_prefill_chunk_after_cached_context():
    start, num_tokens = 6, 7  # positions 6..12, earlier ones already in the pool
    k_cache, v_cache, (table,) = pool_with([start + num_tokens])
    k_all, v_all = seq_kv(k_cache, table, 13), seq_kv(v_cache, table, 13)
    q = torch.randn(num_tokens, HEADS, DIM)
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(13)])
    span = PrefillSpan(0, num_tokens, slots, causal_mask(start, num_tokens, HEADS // KV_HEADS,
                                                         torch.device("cpu")))
    meta = AttentionMetadata(None, 0, [], [span])
    out = paged_attention(q, k_all[start:], v_all[start:], k_cache, v_cache,
                          windowed(meta, WINDOW, BLOCK, torch.float32), DIM**-0.5)
    for i in range(num_tokens):
        torch.testing.assert_close(out[i], reference(q[i], k_all, v_all, start + i, WINDOW))


def test_short_contexts_keep_the_metadata_as_it_is():
    span = PrefillSpan(0, 4, None, causal_mask(0, 4, 2, torch.device("cpu")))
    meta = AttentionMetadata(None, 0, [], [span])
    assert windowed(meta, WINDOW, BLOCK, torch.float32) is meta
