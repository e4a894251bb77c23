"""GGUF K-quant blocks the int4 kernel can run as they are.

Q4_K packs 256 weights as 8 sub-blocks of 32, each with a 6-bit scale and a 6-bit min under
two fp16 super-scales: w = d * sc[s] * q - dmin * m[s], q in 0..15. Per group of 32 that is
exactly worker.model.quant's Int4Blocks form, w = (q - 8) * scale + zero with scale = d * sc
and zero = 8 * scale - dmin * m, so a Q4_K tensor (most of a Q4_K_M file) keeps its 4 bits
for the small-batch kernel. Q5_K, Q6_K and Q8_0 have no such kernel here and are dequantized.
"""

from __future__ import annotations

import numpy as np

from zeroserve.worker.model.quant import Int4Blocks, int4_blocks_from_gguf

QK_K = 256
_Q4_K_BLOCK_BYTES = 144  # d, dmin (fp16 each), 12 bytes of scales/mins, 128 bytes of nibbles


def _q4_k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 12] uint8 -> two [n, 8] 6-bit arrays (llama.cpp's get_scale_min_k4)."""
    lo, hi, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return scales, mins


def q4_k_blocks(raw: np.ndarray) -> Int4Blocks:
    """raw [rows, cols / 256 * 144] uint8 -> Int4Blocks [rows, cols] with groups of 32."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, _Q4_K_BLOCK_BYTES)  # [n, 144], n = rows * cols / 256
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = _q4_k_scales_mins(blocks[:, 4:16])
    scale = d * sc.astype(np.float32)  # [n, 8]
    zero = 8 * scale - dmin * m.astype(np.float32)
    # Each 32-byte chunk j holds sub-block 2j in its low nibbles and 2j + 1 in its high ones.
    nibbles = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (nibbles & 0x0F).reshape(rows, -1)
    return Int4Blocks(q, scale.reshape(rows, -1), zero.reshape(rows, -1))


def int4_blocks(raw: np.ndarray, qtype) -> Int4Blocks | None:
    """The 4-bit blocks of a Q4_0, Q4_1 or Q4_K tensor; None for any other type."""
    from gguf import GGMLQuantizationType as Q

    if qtype == Q.Q4_K:
        return q4_k_blocks(raw)
    return int4_blocks_from_gguf(raw, qtype)
