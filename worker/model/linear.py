"""A projection with an optional low-bit copy for small batches (see worker.model.quant)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.model.quant import PackedInt4, PackedInt8

# Up to this many rows the weight-only int4/int8 kernels beat dense bf16 on the CPU; above,
# the matmul is compute-bound and oneDNN's bf16 path wins (measured: scripts/profile_runner.py).
MAX_PACKED_ROWS = 16


class Linear:
    def __init__(self, dense: torch.Tensor, packed: PackedInt4 | PackedInt8 | None = None):
        self.dense = dense  # [out, in]
        self.packed = packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in] -> [num_tokens, out]."""
        if self.packed is not None and x.shape[0] <= MAX_PACKED_ROWS:
            return self.packed.mm(x)
        return F.linear(x, self.dense)
