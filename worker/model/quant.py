"""4-bit and 8-bit weight-only kernels for small batches on the CPU.

Two families. In bf16, torch's own kernels (PackedInt4, PackedInt8), below. In fp32 (a CPU
without native bf16), torch's low-bit kernels have no vectorized path (30-60x slower than
dense at one row), so the native kernels of worker/csrc/lowbit_matmul.cpp run the file's
blocks as they are (BlockQ4, BlockQ8): 6-8x less to read than the fp32 weights and the same
weight values, so decode rows keep the reference path's numbers up to summation order.
With `--int8-activations`, decode rows instead quantize x to int8 per block of 32 and take
integer dot products over the same blocks (worker/csrc/lowbit_int8.cpp, llama.cpp's way:
BlockQ4.use_int8_activations) through decode_mm; so do the layers' prompt rows, which
Linear sends there too (Linear.int8_all_rows: the int8 kernels beat the bf16 GEMM at every
row count measured, 32-512). `mm` keeps fp32 activations (the lm_head's prompt rows).

A decode step with few sequences is bound by reading the weights (a bf16 matrix-vector product
runs at ~5 GB/s here), so it pays to read 4-bit weights instead: torch's CPU int4 kernel
(`_weight_int4pack_mm_for_cpu`) is ~5x faster than bf16 at one row. GGUF Q4_0/Q4_1 tensors are
already 4-bit with a scale (and offset) per group of 32 inputs, which is exactly the kernel's
format, so no extra quantization error is added beyond rounding scales to bf16. Prefill chunks
are compute-bound and use the dense bf16 copy (same values), where oneDNN is faster; the
kernel is chosen per row (decode or prefill), not by the step's size (worker.model.linear).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

GROUP_SIZE = 32


@dataclass
class Int4Blocks:
    """w[r, c] = (q[r, c] - 8) * scale[r, c // 32] + zero[r, c // 32], rows in HF layout."""

    q: np.ndarray  # [rows, cols] uint8 in 0..15
    scale: np.ndarray  # [rows, cols / 32] float32
    zero: np.ndarray  # [rows, cols / 32] float32

    def map_rows(self, fn) -> Int4Blocks:
        return Int4Blocks(fn(self.q), fn(self.scale), fn(self.zero))

    def dequantize(self, scale_dtype: torch.dtype) -> torch.Tensor:
        """[rows, cols] fp32: the values the int4 kernel computes with (scales in scale_dtype),
        so the dense copy used for large batches matches the kernel for small ones."""
        rows, cols = self.q.shape
        scale = torch.from_numpy(self.scale).to(scale_dtype).float()[..., None]
        zero = torch.from_numpy(self.zero).to(scale_dtype).float()[..., None]
        q = torch.from_numpy(self.q).float().view(rows, cols // GROUP_SIZE, GROUP_SIZE)
        return ((q - 8) * scale + zero).view(rows, cols)

    @staticmethod
    def concat(parts: list[Int4Blocks]) -> Int4Blocks:
        return Int4Blocks(*(np.concatenate(a) for a in zip(*((p.q, p.scale, p.zero) for p in parts),
                                                           strict=True)))


@dataclass
class Int8Blocks:
    """w[r, c] = q[r, c] * scale[r, c // 32] (GGUF Q8_0), rows in HF layout."""

    q: np.ndarray  # [rows, cols] int8
    scale: np.ndarray  # [rows, cols / 32] float32

    def map_rows(self, fn) -> Int8Blocks:
        return Int8Blocks(fn(self.q), fn(self.scale))

    @staticmethod
    def concat(parts: list[Int8Blocks]) -> Int8Blocks:
        return Int8Blocks(np.concatenate([p.q for p in parts]),
                          np.concatenate([p.scale for p in parts]))


def int8_blocks_from_gguf(raw: np.ndarray, qtype) -> Int8Blocks | None:
    """Unpack Q8_0 blocks (d fp16, 32 int8); None for other types."""
    from gguf import GGMLQuantizationType as Q

    if qtype != Q.Q8_0:
        return None
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 2 + GROUP_SIZE)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return Int8Blocks(q, d)


def int4_blocks_from_gguf(raw: np.ndarray, qtype) -> Int4Blocks | None:
    """Unpack Q4_0 (d, 16 bytes) or Q4_1 (d, m, 16 bytes) blocks; None for other types."""
    from gguf import GGMLQuantizationType as Q  # only when parsing a file: gguf imports slowly

    if qtype not in (Q.Q4_0, Q.Q4_1):
        return None
    header = 2 if qtype == Q.Q4_0 else 4
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, header + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., header:]
    # Low nibbles hold elements 0..15 of a block, high nibbles 16..31.
    q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).reshape(rows, -1)
    if qtype == Q.Q4_0:  # w = d * (q - 8)
        zero = np.zeros_like(d)
    else:  # w = d * q + m = d * (q - 8) + (m + 8 d)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    return Int4Blocks(q, d, zero)


class PackedInt4:
    """An Int4Blocks matrix in torch's CPU int4 kernel layout."""

    # Decode rows take this kernel however many there are (worker.model.linear: the choice is
    # per row, so a row's result never depends on its batch). Cost against dense bf16, all 30
    # SmolLM2 layers' weights streaming from memory, 2 threads: 2.4 vs 10.8 ms at 1 row, 10.5
    # vs 14.2 at 16, 15.1 vs 15.7 at 24, 19.7 vs 18.0 at 32; beyond, the dense path is cheaper
    # per row (a price paid for batch independence). (One layer timed over and over keeps its
    # weights in cache and favours dense.)
    prefill_rows = 0  # prompt rows take the dense bf16 kernel (LlamaModel.low_bit_prompt_positions)

    def __init__(self, weight: torch.Tensor, scales_and_zeros: torch.Tensor):
        self.weight = weight  # the kernel's packed layout
        self.scales_and_zeros = scales_and_zeros  # [cols / 32, rows, 2]

    @classmethod
    def from_blocks(cls, blocks: Int4Blocks, dtype: torch.dtype) -> PackedInt4:
        q = torch.from_numpy(blocks.q.astype(np.int32))
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        scales_and_zeros = torch.stack(
            [torch.from_numpy(blocks.scale).t(), torch.from_numpy(blocks.zero).t()], dim=-1
        ).to(dtype).contiguous()
        return cls(weight, scales_and_zeros)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, GROUP_SIZE,
                                                          self.scales_and_zeros)


class PackedInt8:
    """Per-row symmetric int8 (for the lm_head, which GGUF keeps at 8 bits or more)."""

    # Every sampled row takes this kernel, however many (per row, as PackedInt4). torch's int8
    # kernel wins for few rows (49152 x 576 lm_head, 2 threads: 0.7 vs 2.3 ms at 1 row, 1.6 vs
    # 2.8 at 8, 2.3 vs 3.2 at 12, 3.2 vs 3.5 at 16, 4.9 vs 4.0 at 24).
    prefill_rows = 0

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor):
        self.weight = weight  # [rows, cols] int8
        self.scales = scales  # [rows]

    @classmethod
    def quantize(cls, dense: torch.Tensor, dtype: torch.dtype) -> PackedInt8:
        w = dense.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [rows]
        return cls(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8),
                   scale.to(dtype))

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.weight, self.scales)


def _in_panels(a: np.ndarray) -> np.ndarray:
    """[rows, blocks, n] per-output-feature data -> [panels, blocks, 16 * n]: for each panel
    of 16 features (the rows padded with zeros to a multiple of 16) and block, its n entries
    for the 16 features together (worker/csrc/lowbit_matmul.cpp's layout)."""
    rows, blocks, n = a.shape
    panels = -(-rows // 16)
    a = np.pad(a, ((0, panels * 16 - rows), (0, 0), (0, 0))).reshape(panels, 16, blocks, n)
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).reshape(panels, blocks, n * 16)


def _scale_bytes(*scales: np.ndarray) -> list[np.ndarray]:
    """Each of `scales` ([rows, blocks] fp32) in panels as bytes: fp16 where every value of
    all of them is exactly an fp16 (GGUF's Q4_0, Q4_1 and Q8_0 store theirs so: fewer bytes
    to read for the same values), else fp32."""
    half = all(np.array_equal(s.astype(np.float16).astype(np.float32), s) for s in scales)
    dtype = np.float16 if half else np.float32
    return [_in_panels(s.astype(dtype)[..., None]).view(np.uint8) for s in scales]


def _units(*parts: np.ndarray) -> torch.Tensor:
    """[panels, blocks, bytes] parts -> one uint8 [panels, blocks, unit] tensor, each
    (panel, block)'s parts one after another."""
    return torch.from_numpy(np.concatenate([p.view(np.uint8) for p in parts], axis=2))


def _scales_of(data: torch.Tensor, values_bytes: int, count: int) -> torch.Tensor:
    """The `count` scale-like arrays after `values_bytes` in each unit of `data` (a BlockQ4 or
    BlockQ8 tensor), as [count, panels * 16, blocks] fp32."""
    panels, blocks, unit = data.shape
    dtype = torch.float16 if unit - values_bytes == count * 32 else torch.float32
    scales = data[..., values_bytes:].contiguous().view(dtype).float()
    scales = scales.view(panels, blocks, count, 16)
    return scales.permute(2, 0, 3, 1).reshape(count, panels * 16, blocks)


class BlockQ4:
    """An Int4Blocks matrix for worker/csrc's q4_matmul, w = q * scale + offset per block of
    32, in panels of 16 output features, one uint8 tensor [panels, blocks * unit]: per panel
    and block, 256 bytes (for l in 0..15, 16 bytes, one per feature, with q[32b + l] in the
    low nibble and q[32b + 16 + l] in the high one), then the 16 features' scales and their
    offsets (fp16 where all are exact in fp16, else fp32). A row of the kernel's output is 16
    features at once, so the panel keeps those features' weights for one input together, and
    a panel's weights are read as one stream."""

    # Decode rows always take this kernel (Linear), and so do prompt rows at positions below
    # this (LlamaModel.low_bit_prompt_positions): all 30 layers of the default model, 2
    # threads, q4 against dense fp32 MKL: 47 vs 119 ms at 32 rows, 83-92 vs 99-114 at 64,
    # 168 vs 144 at 128.
    prefill_rows = 64

    def __init__(self, data: torch.Tensor, out_features: int):
        self.data = data  # [panels, blocks, unit] uint8
        self.out_features = out_features  # the last panel may be partly padding
        self._kernel = _native().q4_matmul
        self.int8_activations = False  # decode rows: x quantized to int8 (use_int8_activations)
        self._decode_kernel = self._kernel

    @staticmethod
    def tensors(blocks: Int4Blocks) -> torch.Tensor:
        rows, cols = blocks.q.shape
        q = blocks.q.reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
        pairs = q[..., :16] | (q[..., 16:] << 4)  # [row, block, l]
        scale = blocks.scale.astype(np.float32)
        offset = blocks.zero.astype(np.float32) - 8 * scale  # (q - 8) s + z = q s + (z - 8 s)
        return _units(_in_panels(pairs), *_scale_bytes(scale, offset))

    def dequantize(self) -> torch.Tensor:
        """[rows, cols] fp32: the weights the kernel computes with."""
        panels, blocks, _ = self.data.shape
        packed = self.data[..., :256].reshape(panels, blocks, 16, 16)  # [panel, block, l, feature]
        q = torch.cat([packed & 0xF, packed >> 4], dim=2).float()  # [panel, block, 32, feature]
        q = q.permute(0, 3, 1, 2).reshape(panels * 16, blocks, GROUP_SIZE)
        scales, offsets = _scales_of(self.data, 256, 2)
        w = q * scales[..., None] + offsets[..., None]
        return w.reshape(panels * 16, -1)[: self.out_features]

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, self.data, self.out_features)

    def decode_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x's rows as decode rows: mm's product, or with int8 activations where they are
        on (worker/csrc/lowbit_int8.cpp, the same blocks)."""
        return self._decode_kernel(x, self.data, self.out_features)

    def use_int8_activations(self) -> None:
        """Decode rows (decode_mm) from now on quantize x to int8 per block of 32 and take
        integer dot products (`--int8-activations`); mm, for prompt rows, is unchanged."""
        self.int8_activations = True
        self._decode_kernel = _native().q4_matmul_i8


class BlockQ8:
    """An Int8Blocks matrix (GGUF Q8_0: the tied embedding and lm_head of most files) for
    worker/csrc's q8_matmul, w = q * scale per block of 32, in panels of 16 output features,
    one uint8 tensor [panels, blocks, unit]: per panel and block, for each of its 32 inputs
    the 16 features' int8 values, then the 16 features' scales (fp16 where all are exact in
    fp16, else fp32)."""

    prefill_rows = 64  # as BlockQ4's

    def __init__(self, data: torch.Tensor, out_features: int):
        self.data = data  # [panels, blocks, unit] uint8
        self.out_features = out_features
        self._kernel = _native().q8_matmul
        self.int8_activations = False  # as BlockQ4's
        self._decode_kernel = self._kernel

    @staticmethod
    def tensors(blocks: Int8Blocks) -> torch.Tensor:
        rows, cols = blocks.q.shape
        values = _in_panels(blocks.q.reshape(rows, cols // GROUP_SIZE, GROUP_SIZE))
        return _units(values, *_scale_bytes(blocks.scale.astype(np.float32)))

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, self.data, self.out_features)

    def decode_mm(self, x: torch.Tensor) -> torch.Tensor:
        return self._decode_kernel(x, self.data, self.out_features)

    def use_int8_activations(self) -> None:
        self.int8_activations = True
        self._decode_kernel = _native().q8_matmul_i8


def _native():
    from zeroserve.worker import cpu_kernels  # builds (or loads) the kernels on first use

    module = cpu_kernels.load(required=True)
    _register_shapes()
    return module


@functools.cache
def _register_shapes() -> None:
    """Output shapes of torch.ops.zeroserve.q4_matmul / q8_matmul and their int8-activation
    twins (_i8), for tracing (the module registers the operators when it loads)."""

    def _shape(x, blocks, out_features):
        return x.new_empty(x.shape[0], out_features)

    for name in ("q4_matmul", "q8_matmul", "q4_matmul_i8", "q8_matmul_i8"):
        torch.library.register_fake(f"zeroserve::{name}")(_shape)


def block_kernels_available() -> bool:
    """True where worker/csrc builds (a compiler and ninja) on this machine."""
    from zeroserve.worker import cpu_kernels

    return cpu_kernels.load() is not None


def int4_kernels_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch, "_weight_int8pack_mm"
    )
