"""A projection with an optional low-bit copy for decode rows (see worker.model.quant)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zeroserve.worker.model.batch_invariance import tiled_linear
from zeroserve.worker.model.quant import PackedInt4, PackedInt8


class Linear:
    def __init__(self, dense: torch.Tensor, packed: PackedInt4 | PackedInt8 | None = None,
                 tile_rows: int | None = None, per_row: bool = True):
        self.dense = dense  # [out, in]
        self.packed = packed
        # True: the kernel is chosen per row (below), so no row's result depends on its batch
        # (what --batch-invariant needs). False: by the call's row count, the faster choice
        # where the dense kernel is native: the low-bit copy while reading weights dominates
        # (up to packed.max_rows rows), the dense kernel beyond (LlamaModel decides).
        self.per_row = per_row
        # Dense calls of exactly this many rows where the dense kernel's result for a row
        # depends on how many rows share the call (worker.model.batch_invariance); None: one
        # call. Only beside a low-bit copy: then the dense path takes prefill rows alone, and
        # a single decode row never pays for a tile.
        self.tile_rows = tile_rows if packed is not None else None

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_rows is None:
            return F.linear(x, self.dense)
        return tiled_linear(x, self.dense, self.tile_rows)

    def __call__(self, x: torch.Tensor, num_packed_rows: int | None = None) -> torch.Tensor:
        """x [num_tokens, in] -> [num_tokens, out]. Per row, the first `num_packed_rows` rows
        (None: all) go through the low-bit copy where there is one, the others through the
        dense weight; otherwise `num_packed_rows` is ignored and the row count decides.

        Per row, the kernel never depends on how many rows the step has: each kernel
        computes a row on its own, so a row's output does not depend on what shares its batch
        (docs/architecture.md, "Batch independence"). The model passes its decode rows, which
        are bound by reading weights (the low-bit copy reads 4x less); prefill chunks are
        compute-bound, where oneDNN's dense path wins, except that up to
        `packed.prefill_rows` of them (the native fp32 block kernels: 64) take the low-bit
        copy with the decode rows, where it is the faster kernel for them too. Which kernel a
        prefill row takes then depends on the step's prefill rows, as the dense kernel's
        rounding already does; a decode row's never changes.
        """
        rows = x.shape[0]
        if not self.per_row:
            if self.packed is not None and rows <= self.packed.max_rows:
                return self.packed.mm(x)
            return F.linear(x, self.dense)
        num_packed = rows if num_packed_rows is None else min(num_packed_rows, rows)
        if self.packed is None:
            return self._dense(x)
        if rows - num_packed <= self.packed.prefill_rows:
            # A few prefill rows ride with the decode rows where the low-bit kernel is the
            # faster one for them too (the native block kernels, below ~100 rows).
            return self.packed.mm(x)
        if num_packed == 0:
            return self._dense(x)
        out = x.new_empty(rows, self.dense.shape[0])
        out[:num_packed] = self.packed.mm(x[:num_packed])
        out[num_packed:] = self._dense(x[num_packed:])
        return out
