"""Attention over the paged KV cache.

The KV pool is one K and one V tensor per layer, `[num_blocks, block_size, kv_heads, head_dim]`.
A token at position p of a sequence lives in slot `block_table[p // block_size] * block_size +
p % block_size` of the flattened pool `[num_blocks * block_size, kv_heads, head_dim]`.

Every step the runner builds one `AttentionMetadata` (index tensors and masks for the whole
batch); all layers reuse it. The projections and MLP see the flattened batch without padding;
only attention pads: decode rows are batched together (in a few groups of similar context
length), each prefill chunk runs on its own with a causal mask offset by its start position.

On the CPU (bf16 or fp32), decode rows go instead to a native kernel (worker/csrc, built by
worker.cpu_kernels) that reads K/V in place through the block tables: no gathered copy, no
padding, no length groups. Prompt rows take the same kernel, one row at a time: a row at
position p attends to keys 0 .. p of its table, computed in an order that depends on p alone,
so a prompt row comes out bit for bit alike whole, in chunks of any size, or after a
prefix-cache hit (docs/architecture.md, "Batch independence"), with no query tiles, key
padding, gathered context or mask, and one parallel region per layer instead of one per tile.
Measured per layer against SDPA in causal 32-row tiles: on one thread about even for long
prompts (1,000 tokens 28.5 vs 27.9 ms fp32; 512 after 512, 22.7 vs 17.1) and 2-6x cheaper for
the short chunks of a prefix-cache hit; on two threads of a loaded machine 10-30x cheaper
(every tile's barrier waits for a descheduled thread). The torch path below stays for other
devices and dtypes, for sliding windows, and as the fallback where the kernel cannot be built.

Grouped-query attention never copies K/V per query head: the query heads that share a KV head
are folded into one matrix (`[kv_heads, group * q_len, head_dim]`), so one matmul or SDPA call
covers the group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zeroserve.worker import cpu_kernels


@dataclass
class PrefillSpan:
    """One prefill chunk: rows [start, end) of the batch, at positions start_pos.. ."""

    start: int
    end: int
    # [context_len] pool slots of positions 0 .. context_len-1; None when the chunk is the
    # whole context (start_pos == 0), so it attends to its own fresh K/V without a gather.
    context_slots: torch.Tensor | None
    # [group * num_tokens, context_len] True where a query may attend (causal, offset by
    # start_pos); rows repeat per query head of a KV group.
    mask: torch.Tensor
    # The chunk's first rows that the native prompt kernel computes (paged_prompt's rows):
    # those at positions below NATIVE_PROMPT_POSITIONS; _prefill_attention takes the rest.
    native_rows: int = 0


@dataclass
class DecodeGroup:
    """Decode rows [start, end) of the batch, attended together over a padded context."""

    start: int
    end: int
    # [num_rows * max_context / block_size] each row's blocks, padded with block 0.
    blocks: torch.Tensor
    # [num_rows, 1, max_context] in the model dtype: 0 for real context positions, -inf for
    # padding.
    bias: torch.Tensor
    max_context: int  # a whole number of blocks


# (q [rows, heads, d], k_cache, v_cache, block_tables, context_lens, scale) -> [rows, heads * d]
DecodeKernel = Callable[..., torch.Tensor]


@dataclass
class PagedDecode:
    """Rows for a native kernel that reads the pool in place: row i attends to positions
    0 .. context_lens[i] - 1 of its table. All decode rows [0, num_decode) (paged_decode), or
    all prompt rows [num_decode, num_tokens) (paged_prompt)."""

    kernel: DecodeKernel
    block_tables: torch.Tensor  # [num_rows, max_blocks] int32, padded with 0 (never read)
    context_lens: torch.Tensor  # [num_rows] int32
    # paged_prompt only: the batch rows it computes, where not every prompt row (rows at
    # positions from NATIVE_PROMPT_POSITIONS on take _prefill_attention); None: all of them.
    rows: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    # [num_tokens] pool slot for each new token's K/V; None runs without a cache (reference).
    slot_mapping: torch.Tensor | None
    # The first num_decode rows are single-token decodes of distinct sequences. They run
    # either through a native kernel (paged_decode) or in torch, split into decode_groups of
    # similar context length so short contexts are not padded to the longest.
    num_decode: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    paged_decode: PagedDecode | None = None
    # The rows that take the projections' low-bit copies (worker.model.linear.LowBitRows):
    # the first N rows, or (those rows, the others) as index tensors where they are not a
    # prefix (ModelRunner). None: the decode rows.
    low_bit_rows: int | tuple[torch.Tensor, torch.Tensor] | None = None
    # Every prefill row, for the native kernel (one row at a time, causal by its context
    # length); None: the prefills run through _prefill_attention.
    paged_prompt: PagedDecode | None = None

    @property
    def low_bit(self) -> int | tuple[torch.Tensor, torch.Tensor]:
        return self.num_decode if self.low_bit_rows is None else self.low_bit_rows


def causal_mask(start_pos: int, num_tokens: int, group: int, device: torch.device) -> torch.Tensor:
    """[group * num_tokens, start_pos + num_tokens]: query i sees keys 0 .. start_pos + i."""
    query_pos = torch.arange(start_pos, start_pos + num_tokens, device=device)
    key_pos = torch.arange(start_pos + num_tokens, device=device)
    mask = key_pos[None, :] <= query_pos[:, None]  # [num_tokens, context_len]
    return mask.repeat(group, 1)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([num_tokens, kv_heads, head_dim]) in their slots."""
    # The native copy where start-up loaded the CPU kernels (never a build mid-step): one
    # call instead of two index_copy_, the same pool.
    native = cpu_kernels.loaded() if k_cache.device.type == "cpu" else None
    if native is not None:  # rounds fp32 K/V into a bf16 pool itself
        native.write_kv(k_cache, v_cache, k, v, slot_mapping)
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


@functools.cache
def _eye(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A shared identity matrix, built once rather than per layer per step."""
    return torch.eye(size, dtype=dtype, device=device)


def _fold_group(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[n, heads, d] -> [kv_heads, group * n, d] (head h = kv * group + g, as HF repeat_kv)."""
    n, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    return q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(
        num_kv_heads, group * n, head_dim
    )


def _unfold_group(out: torch.Tensor, n: int) -> torch.Tensor:
    """[kv_heads, group * n, d] -> [n, heads * d]."""
    num_kv_heads, rows, head_dim = out.shape
    group = rows // n
    return out.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, -1)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      group: DecodeGroup, scale: float) -> torch.Tensor:
    """q [rows, heads, d] -> [rows, heads * d], reading K/V from the pool.

    One query per sequence makes per-head matmuls tiny ([group, d] x [d, L]), where CPU
    kernels are slow, and SDPA slower still. Instead each row's gathered K/V stay in their
    pool layout `[L, kv_heads * d]` and the queries go into a block-diagonal matrix
    `[heads, kv_heads * d]` (head h only has entries in its KV head's columns): two bmm calls
    of healthy shapes, no transposed copies. The zero blocks triple the (small) attention
    FLOPs; measured 1.3-2x faster than per-head bmm at 16-32 rows.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    length = group.max_context
    # Whole blocks at a time: [rows * blocks, block_size * kv_heads * d] -> [rows, L, kv * d]
    k = k_cache.view(k_cache.shape[0], -1).index_select(0, group.blocks).view(n, length, -1)
    v = v_cache.view(v_cache.shape[0], -1).index_select(0, group.blocks).view(n, length, -1)
    k, v = k.to(q.dtype), v.to(q.dtype)  # a bf16 pool under fp32 q (--kv-cache-dtype): exact
    eye = _eye(num_kv_heads, q.dtype, q.device)
    # [rows, heads, kv_heads * d]: head (j, g) holds q in KV head j's columns, zeros elsewhere.
    q_block = (q.view(n, num_kv_heads, group_size, 1, head_dim)
               * eye.view(1, num_kv_heads, 1, num_kv_heads, 1)).view(n, num_heads, -1)
    # Scale and padding bias fused into the matmul, all in the model dtype: with bf16 the
    # scores are bf16 anyway, and the bias (0 / -inf) and a power-of-two scale are exact.
    # The CPU softmax accumulates reduced-precision inputs in fp32 internally, so it gives
    # the same probabilities as an explicit fp32 round trip, minus two copies (measured
    # 0.40 -> 0.37 ms per layer at 16 rows x 256 context, identical output).
    scores = torch.baddbmm(group.bias, q_block, k.transpose(1, 2), alpha=scale)  # [rows, heads, L]
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs, v).view(n, num_kv_heads, group_size, num_kv_heads, head_dim)
    # Keep each head's own KV block: [rows, group, d, kv] -> [rows, heads * d]
    out = torch.diagonal(out, dim1=1, dim2=3).permute(0, 3, 1, 2)
    return out.reshape(n, num_heads * head_dim)


# Prefill attention runs the queries of a chunk in calls of this many (_prefill_attention).
PREFILL_QUERY_TILE = 32
# Prompt rows at positions below this attend through the native kernel, one row at a time
# (paged_prompt: 2-6x cheaper than SDPA's tiles for short chunks); later rows through
# _prefill_attention's tiles, which share each tile's key loads and win on long contexts
# (a lone 6,000-token prompt: 23.7 s all native against 15.6 s all tiles, 2 cores). By
# position, a multiple of the tile, so a row's kernel does not depend on its chunk.
NATIVE_PROMPT_POSITIONS = 512


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                       span: PrefillSpan, scale: float) -> torch.Tensor:
    """One chunk: q [n, heads, d], its fresh k/v [n, kv_heads, d] -> [n, heads * d]."""
    n = q.shape[0]  # the chunk's rows from span.native_rows on
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if span.context_slots is not None:
        # Earlier positions are in the pool (this chunk's K/V were just written there too).
        k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, span.context_slots)
        v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, span.context_slots)
    elif k_cache is not None and k_cache.dtype != q.dtype:
        # Fresh K/V as the pool holds them (bf16 under fp32 q): the same values as a later
        # chunk reads back, so a row's result does not depend on its chunk.
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k, v = k.to(q.dtype), v.to(q.dtype)
    # SDPA computes a query row differently by the blocks it cuts the queries into, which
    # follow the call's query count (blocks of 32, 64 or 256 rows; a block of one to three
    # rows takes another product), and by the row's place in its block: the same row came
    # out 3e-8 (fp32) to 0.008 (bf16, one layer) apart within the whole prompt and within the
    # chunk left after a prefix-cache hit, enough to change a greedy token. So every call
    # has the same number of queries, a tile of PREFILL_QUERY_TILE rows aligned to absolute
    # positions (a row's place in its tile is its position modulo the tile), the ends filled
    # with copies of the chunk's first and last queries.
    tile = PREFILL_QUERY_TILE
    num_tokens = span.end - span.start
    group = span.mask.shape[0] // num_tokens
    mask = span.mask.view(group, num_tokens, -1)[:, span.native_rows:]  # [group, n, context]
    lead = (mask.shape[-1] - n) % tile  # the chunk's start position, modulo the tile
    trail = -(lead + n) % tile
    first = mask.shape[-1] - n - lead  # the absolute position of the first tile's first row
    if lead or trail:
        q = torch.cat([q[:1].expand(lead, -1, -1), q, q[-1:].expand(trail, -1, -1)])
        mask = torch.cat([mask[:, :1].expand(-1, lead, -1), mask,
                          mask[:, -1:].expand(-1, trail, -1)], dim=1)
    # The keys too come in whole tiles (masked zeros after the context): a key's score is
    # computed alike whatever the context's length modulo the kernel's blocks, so a row
    # computed in a chunk that ends earlier (chunked prefill) matches the whole prompt's.
    key_pad = -mask.shape[-1] % tile
    if key_pad:
        k = torch.cat([k, k.new_zeros(key_pad, *k.shape[1:])])
        v = torch.cat([v, v.new_zeros(key_pad, *v.shape[1:])])
        mask = torch.cat([mask, mask.new_zeros(*mask.shape[:2], key_pad)], dim=2)
    # [1, kv_heads, context, d], laid out alike whether read from the pool or fresh (SDPA's
    # products take other paths for other strides)
    k = k.transpose(0, 1).contiguous()[None]
    v = v.transpose(0, 1).contiguous()[None]
    out = q.new_empty(q.shape[0], q.shape[1] * head_dim)
    for start in range(0, q.shape[0], tile):
        # Causal: no row of a tile sees a key past the tile's end, so a tile takes the keys
        # up to there and no more (half the work of a whole prompt), and their count follows
        # from the tile's position alone, whatever the chunk.
        keys = first + start + tile
        # 4-D inputs (a batch of one): with 3-D ones torch's CPU SDPA falls back to its math
        # path, 2-3x slower here than the fused kernel it picks for 4-D.
        tile_out = F.scaled_dot_product_attention(
            _fold_group(q[start:start + tile], num_kv_heads)[None], k[:, :, :keys],
            v[:, :, :keys], attn_mask=mask[:, start:start + tile, :keys].reshape(group * tile, -1),
            scale=scale)
        out[start:start + tile] = _unfold_group(tile_out[0], tile)
    return out[lead:lead + n]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [num_tokens, heads, d], k/v [num_tokens, kv_heads, d] -> [num_tokens, heads * d].

    Writes the new K/V into the pool first, so every row reads its full context from it.
    """
    if meta.slot_mapping is not None:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    paged, prompt = meta.paged_decode, meta.paged_prompt
    if paged is not None and not meta.prefills:
        return paged.kernel(q, k_cache, v_cache, paged.block_tables, paged.context_lens, scale)
    if prompt is not None and not meta.num_decode and prompt.rows is None:
        return prompt.kernel(q, k_cache, v_cache, prompt.block_tables, prompt.context_lens,
                             scale)
    if len(meta.decode_groups) == 1 and not meta.prefills:
        return _decode_attention(q, k_cache, v_cache, meta.decode_groups[0], scale)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    if paged is not None and meta.num_decode:
        out[: meta.num_decode] = paged.kernel(q[: meta.num_decode], k_cache, v_cache,
                                              paged.block_tables, paged.context_lens, scale)
    for group in meta.decode_groups:
        rows = slice(group.start, group.end)
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, group, scale)
    if prompt is not None:
        if prompt.rows is None:
            out[meta.num_decode:] = prompt.kernel(q[meta.num_decode:], k_cache, v_cache,
                                                  prompt.block_tables, prompt.context_lens,
                                                  scale)
            return out
        out.index_copy_(0, prompt.rows, prompt.kernel(
            q.index_select(0, prompt.rows), k_cache, v_cache, prompt.block_tables,
            prompt.context_lens, scale))
    for span in meta.prefills:
        if span.start + span.native_rows == span.end:
            continue
        chunk = slice(span.start, span.end)
        out[span.start + span.native_rows:span.end] = _prefill_attention(
            q[span.start + span.native_rows:span.end], k[chunk], v[chunk], k_cache, v_cache,
            span, scale)
    return out
