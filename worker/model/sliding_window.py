"""Sliding-window attention over the paged KV cache (Mistral, windowed Qwen layers).

A query at position q sees keys k with q - window < k <= q, as transformers masks it. The
cache keeps every block (a sequence's K/V are not dropped as the window moves on); the window
is a mask on the step's attention metadata, built once per step and shared by the windowed
layers. A step in which no sequence's context is longer than the window runs unchanged.
"""

from __future__ import annotations

import dataclasses

import torch

from zeroserve.worker.attention import AttentionMetadata, DecodeGroup, PrefillSpan


def _prefill(span: PrefillSpan, window: int) -> PrefillSpan:
    rows, context_len = span.mask.shape  # rows = group * num_tokens
    num_tokens = span.end - span.start
    start_pos = context_len - num_tokens
    device = span.mask.device
    query_pos = start_pos + torch.arange(rows, device=device) % num_tokens  # [rows]
    key_pos = torch.arange(context_len, device=device)
    in_window = key_pos[None, :] > query_pos[:, None] - window
    # Every row through _prefill_attention: the native prompt kernel sees no window.
    return dataclasses.replace(span, mask=span.mask & in_window, native_rows=0)


def _window_bias(bias: torch.Tensor, context_lens: torch.Tensor, window: int) -> torch.Tensor:
    """bias [rows, 1, L] with keys before each row's window masked (-inf) as well."""
    key_pos = torch.arange(bias.shape[-1], device=bias.device)
    too_old = key_pos[None, :] < (context_lens[:, None] - window)  # [rows, L]
    return bias.masked_fill(too_old[:, None, :], float("-inf"))


def _decode_group(group: DecodeGroup, window: int) -> DecodeGroup:
    context_lens = (group.bias[:, 0, :] == 0).sum(dim=-1)  # padding (-inf) sits at the end
    return dataclasses.replace(group, bias=_window_bias(group.bias, context_lens, window))


def _needs_window(meta: AttentionMetadata, window: int) -> bool:
    if any(span.mask.shape[1] > window for span in meta.prefills):
        return True
    if any(group.max_context > window for group in meta.decode_groups):
        return True
    paged = meta.paged_decode
    return paged is not None and int(paged.context_lens.max()) > window


def windowed(meta: AttentionMetadata, window: int, block_size: int,
             dtype: torch.dtype) -> AttentionMetadata:
    """`meta` with every query restricted to its last `window` keys."""
    if not _needs_window(meta, window):
        return meta
    groups = [_decode_group(g, window) for g in meta.decode_groups]
    paged = meta.paged_decode
    if paged is not None:
        # The native decode kernel attends to the whole context: run these rows through the
        # torch decode path, whose bias carries the window.
        tables = paged.block_tables.long()  # [rows, max_blocks]
        lens = paged.context_lens.long()
        max_context = tables.shape[1] * block_size
        padding = torch.arange(max_context, device=lens.device)[None, :] >= lens[:, None]
        bias = torch.zeros(len(lens), 1, max_context, dtype=dtype, device=lens.device)
        bias = _window_bias(bias.masked_fill(padding[:, None, :], float("-inf")), lens, window)
        groups.insert(0, DecodeGroup(0, meta.num_decode, tables.flatten(), bias, max_context))
    # Prompt rows likewise: the torch path, through their windowed masks.
    return dataclasses.replace(meta, decode_groups=groups, paged_decode=None, paged_prompt=None,
                               prefills=[_prefill(s, window) for s in meta.prefills])
