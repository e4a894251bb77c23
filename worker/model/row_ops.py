"""A layer's small per-row operations: RMSNorm, the residual add before a norm, rotary and
SwiGLU's silu(gate) * up.

On the CPU in fp32 they run as one native call each (worker/csrc/row_ops.cpp): at one decode
row torch's RMSNorm alone is six dispatches of a few microseconds for 576 numbers, and 61 of
them a step took more time than the step's 4-bit projections. Elsewhere (bf16, CUDA, no
compiler) torch computes them. Both give HF's operations in HF's order: rotary bit for bit,
the norms up to the order of the sum of squares, silu within ~1e-6 relative (a polynomial
exp); every row is computed on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_dim], rotate-half layout: dim i pairs with i + head_dim/2.
    Same products and sums as HF's `q * cos + rotate_half(q) * sin`, so fp32 matches bit for bit."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin


class TorchRowOps:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, rms_norm(x + delta))."""
        x = x + delta
        return x, self.rms_norm(x, weight, eps)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * width] (gate, then up) -> silu(gate) * up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class NativeRowOps(TorchRowOps):
    def __init__(self, module):
        self.module = module  # worker/csrc's kernels (LlamaLayer.decode_native calls them)
        self._rms_norm = module.rms_norm
        self._add_rms_norm = module.add_rms_norm
        self._rotary = module.rotary
        self._silu_mul = module.silu_mul

    def rms_norm(self, x, weight, eps):
        return self._rms_norm(x.contiguous(), weight, eps)

    def add_rms_norm(self, x, delta, weight, eps):
        return self._add_rms_norm(x.contiguous(), delta.contiguous(), weight, eps)

    def rotary(self, x, cos, sin):
        return self._rotary(x, cos, sin)

    def silu_mul(self, gate_up):
        return self._silu_mul(gate_up.contiguous())


def row_ops(device: torch.device, dtype: torch.dtype) -> TorchRowOps:
    """The native ops on the CPU in fp32 where worker/csrc builds, torch's otherwise."""
    if device.type == "cpu" and dtype == torch.float32:
        from zeroserve.worker import cpu_kernels

        module = cpu_kernels.load()
        if module is not None:
            return NativeRowOps(module)
    return TorchRowOps()
