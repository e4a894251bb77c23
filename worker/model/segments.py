"""A decoder layer's decode-row work between its attention calls, as two plain functions.

A decode step spends its time in four projections per layer and, around them, about fifteen
small ops (RMSNorm's pow/mean/rsqrt/mul, rotary's slices and cat, biases, residual adds,
SwiGLU's silu and mul). Written as functions of tensors only (weights are arguments, layer
variants are arguments that may be None), one traced or captured copy of each serves every
layer of the same kind: `attention_in` (input norm, QKV projection, bias, Q/K norms, rotary)
and `attention_out` (output projection, bias, residual, post norm, gate/up, SwiGLU, down,
residual). worker/model/compiled.py hands them to inductor on the CPU and
worker/model/cuda_graphs.py captures them in CUDA graphs; attention, which reads the paged
cache through per-step block tables, runs eagerly between the two.

The math is LlamaLayer.forward's for rows that are all decodes (every projection takes its
low-bit copy where it has one, as Linear does for decode rows), so the segments compute the
same values; a fused kernel may round differently in the last bit, and every row is computed
on its own (tests/worker/test_compiled.py checks both against the eager layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zeroserve.worker.attention import AttentionMetadata
from zeroserve.worker.model.linear import Linear
from zeroserve.worker.model.llama import LlamaLayer
from zeroserve.worker.model.llama_config import LlamaConfig
from zeroserve.worker.model.quant import GROUP_SIZE, BlockQ4, BlockQ8, PackedInt4, PackedInt8

# (dense [out, in], kind, low-bit tensors): kind names the low-bit copy decode rows use
# ("int4", "int8": torch's kernels; "q4", "q8": the native block kernels, "q4_i8", "q8_i8" the
# same with int8 activations; None: the dense weight).
LinearTensors = tuple[torch.Tensor, str | None, tuple[torch.Tensor, ...]]


def linear_tensors(linear: Linear) -> LinearTensors:
    packed = linear.packed
    if isinstance(packed, PackedInt4):
        return linear.dense, "int4", (packed.weight, packed.scales_and_zeros)
    if isinstance(packed, PackedInt8):
        return linear.dense, "int8", (packed.weight, packed.scales)
    if isinstance(packed, BlockQ4 | BlockQ8):
        kind = ("q4" if isinstance(packed, BlockQ4) else "q8") + (
            "_i8" if packed.int8_activations else "")
        # Without a dense copy (prepare.INT8_ROWS) an empty [out, 0] stands for its shape:
        # block kinds read only its size.
        dense = linear.dense if linear.dense is not None else torch.empty(packed.out_features, 0)
        return dense, kind, (packed.data,)
    return linear.dense, None, ()


def decode_rows(x: torch.Tensor, weights: LinearTensors) -> torch.Tensor:
    """x [rows, in] -> [rows, out] as Linear computes decode rows: the low-bit copy if any."""
    dense, kind, low_bit = weights
    if kind == "int4":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, low_bit[0], GROUP_SIZE, low_bit[1])
    if kind == "int8":
        return torch._weight_int8pack_mm(x, *low_bit)
    if kind == "q4":
        return torch.ops.zeroserve.q4_matmul(x, *low_bit, dense.shape[0])
    if kind == "q8":
        return torch.ops.zeroserve.q8_matmul(x, *low_bit, dense.shape[0])
    if kind == "q4_i8":
        return torch.ops.zeroserve.q4_matmul_i8(x, *low_bit, dense.shape[0])
    if kind == "q8_i8":
        return torch.ops.zeroserve.q8_matmul_i8(x, *low_bit, dense.shape[0])
    return F.linear(x, dense)


@dataclass(frozen=True)
class LayerTensors:
    """One layer's weights as the segments take them (None where the layer has none)."""

    input_norm: torch.Tensor
    qkv: LinearTensors
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: LinearTensors
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: LinearTensors
    down: LinearTensors

    @classmethod
    def of(cls, layer: LlamaLayer) -> LayerTensors:
        return cls(layer.input_norm, linear_tensors(layer.qkv), layer.qkv_bias, layer.q_norm,
                   layer.k_norm, linear_tensors(layer.o_proj), layer.o_bias, layer.post_norm,
                   linear_tensors(layer.gate_up), linear_tensors(layer.down))

    def attention_in_args(self) -> tuple:
        return self.input_norm, self.qkv, self.qkv_bias, self.q_norm, self.k_norm

    def attention_out_args(self) -> tuple:
        return self.o_proj, self.o_bias, self.post_norm, self.gate_up, self.down


def is_pure_decode(meta: AttentionMetadata, num_tokens: int, max_batch_size: int) -> bool:
    """A step the fused segments can run: every row a single decode token, at most
    `max_batch_size` of them (the compiled and the CUDA-graph step alike)."""
    return not meta.prefills and meta.num_decode == num_tokens and 1 <= num_tokens <= max_batch_size


def make_segments(cfg: LlamaConfig):
    """(attention_in, attention_out) for this model shape; the shape's numbers are constants
    of the functions, so a compiler specializes on them."""
    hidden, eps, head_dim = cfg.hidden_size, cfg.rms_norm_eps, cfg.head_dim
    num_heads, num_kv_heads = cfg.num_heads, cfg.num_kv_heads
    qk_size = cfg.q_size + cfg.kv_size
    half = head_dim // 2

    def attention_in(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     input_norm: torch.Tensor, qkv_weights: LinearTensors,
                     qkv_bias: torch.Tensor | None, q_norm: torch.Tensor | None,
                     k_norm: torch.Tensor | None):
        """x [rows, hidden], cos/sin [rows, 1, head_dim] -> q [rows, heads, head_dim], k and
        v [rows, kv_heads, head_dim]."""
        n = x.shape[0]
        h = F.rms_norm(x, (hidden,), input_norm, eps)
        qkv = decode_rows(h, qkv_weights)  # [rows, q_size + 2 * kv_size]
        if qkv_bias is not None:
            qkv = qkv + qkv_bias
        qk = qkv[:, :qk_size].view(n, -1, head_dim)
        if q_norm is not None:
            qk = torch.cat([F.rms_norm(qk[:, :num_heads], (head_dim,), q_norm, eps),
                            F.rms_norm(qk[:, num_heads:], (head_dim,), k_norm, eps)], dim=1)
        swapped = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
        qk = qk * cos + swapped * sin  # worker.model.row_ops.apply_rotary
        v = qkv[:, qk_size:].view(n, num_kv_heads, head_dim)
        return qk[:, :num_heads], qk[:, num_heads:], v

    def attention_out(x: torch.Tensor, attn: torch.Tensor, o_weights: LinearTensors,
                      o_bias: torch.Tensor | None, post_norm: torch.Tensor,
                      gate_up_weights: LinearTensors, down_weights: LinearTensors):
        """x [rows, hidden], attn [rows, heads * head_dim] -> the layer's output x."""
        out = decode_rows(attn, o_weights)
        x = x + (out if o_bias is None else out + o_bias)
        h = F.rms_norm(x, (hidden,), post_norm, eps)
        gate, up = decode_rows(h, gate_up_weights).chunk(2, dim=-1)
        return x + decode_rows(F.silu(gate) * up, down_weights)

    return attention_in, attention_out
