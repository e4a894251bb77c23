"""A projection with an optional low-bit copy for small batches (see worker.model.quant)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.model.quant import PackedInt4, PackedInt8


class Linear:
    def __init__(self, dense: torch.Tensor, packed: PackedInt4 | PackedInt8 | None = None):
        self.dense = dense  # [out, in]
        self.packed = packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in] -> [num_tokens, out]."""
        # Few rows: bound by reading weights, the low-bit copy wins. Many rows: compute-bound,
        # oneDNN's dense bf16 path wins.
        if self.packed is not None and x.shape[0] <= self.packed.max_rows:
            return self.packed.mm(x)
        return F.linear(x, self.dense)
