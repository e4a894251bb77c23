"""A projection with an optional low-bit copy for decode rows (see worker.model.quant)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zeroserve.worker.model.batch_invariance import padded_linear, tiled_linear
from zeroserve.worker.model.quant import PackedInt4, PackedInt8

# Which rows of a call take the low-bit copy: the first N, or (those rows, the others).
LowBitRows = int | tuple[torch.Tensor, torch.Tensor]


class Linear:
    def __init__(self, dense: torch.Tensor | None, packed: PackedInt4 | PackedInt8 | None = None,
                 tile_rows: int | None = None, min_rows: int = 1):
        # [out, in]; may be bf16 beside fp32 activations (prepare.BLOCKS_BF16); None where
        # the copy's decode kernel takes every row (prepare.INT8_ROWS: int8 activations).
        self.dense = dense
        self.packed = packed
        # Dense calls of fewer rows are padded to this many, where the dense kernel computes
        # smaller calls another way (worker.model.batch_invariance.dense_min_rows).
        self.min_rows = min_rows
        # Dense calls of exactly this many rows where the dense kernel's result for a row
        # depends on how many rows share the call (worker.model.batch_invariance); None: one
        # call. Only beside a low-bit copy: then the dense path takes prefill rows alone, and
        # a single decode row never pays for a tile.
        self.tile_rows = tile_rows if packed is not None else None
        # Every row, prompt rows too, through the copy's decode kernel (int8 activations):
        # LlamaModel.use_int8_activations sets it for the layers' projections, where the
        # int8 block kernels beat the dense GEMM at any row count (bench_block_kernels.py
        # --prompt-rows). Then all rows of a call take one kernel, whatever the batch.
        self.int8_all_rows = False

    def use_int8_all_rows(self) -> bool:
        """All rows from now on through the copy's int8-activation kernel, where it has one
        (`--int8-activations`). -> whether it does."""
        self.int8_all_rows = bool(getattr(self.packed, "int8_activations", False))
        return self.int8_all_rows

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dense.dtype:  # bf16 dense copies beside fp32 activations
            return self._dense(x.to(self.dense.dtype)).to(x.dtype)
        if self.tile_rows is not None:
            return tiled_linear(x, self.dense, self.tile_rows)
        if x.shape[0] < self.min_rows:
            return padded_linear(x, self.dense, self.min_rows)
        return F.linear(x, self.dense)

    def __call__(self, x: torch.Tensor, low_bit: LowBitRows | None = None,
                 num_decode: int = 0) -> torch.Tensor:
        """x [num_tokens, in] -> [num_tokens, out]. The rows `low_bit` names go through the
        low-bit copy where there is one, the others through the dense weight: an int N for
        the first N rows, or (those rows, the others) as index tensors; None: all rows.

        The caller chooses a row's kernel by what the row is, never by how many rows the step
        has (docs/architecture.md, "Batch independence"): decode rows, which are bound by
        reading weights (the low-bit copy reads 4x less), and a prompt's first positions
        (LlamaModel.low_bit_prompt_positions) take the low-bit copy; later prompt rows are
        compute-bound, where the dense kernel beats the fp32-activation block kernels (but
        not the int8 ones: `int8_all_rows`). So a row's kernel, and with it its result
        on the kernels that compute each row on its own, is the same alone or in any batch,
        and the same whether or not its prompt's beginning came from the prefix cache.
        The first `num_decode` rows (always among the low-bit ones) are decode rows: they
        take the copy's decode kernel, which may quantize them to int8 (`--int8-activations`).
        With `int8_all_rows` (the layers' projections under `--int8-activations`) every row,
        prompt or decode, takes that kernel and `low_bit`/`num_decode` change nothing.
        """
        rows = x.shape[0]
        if self.packed is None:
            return self._dense(x)
        if self.int8_all_rows and self.packed.int8_activations:  # every row alike
            return self.packed.decode_mm(x)
        if self.dense is None:  # no dense copy (prepare.INT8_ROWS): every row on the copy
            return self._low_bit(x, num_decode)
        if isinstance(low_bit, tuple):
            low, dense = low_bit
            out = x.new_empty(rows, self.dense.shape[0])
            out.index_copy_(0, low, self._low_bit(x.index_select(0, low), num_decode))
            out.index_copy_(0, dense, self._dense(x.index_select(0, dense)))
            return out
        num_low_bit = rows if low_bit is None else min(low_bit, rows)
        if num_low_bit == 0:
            return self._dense(x)
        if num_low_bit == rows:
            return self._low_bit(x, num_decode)
        out = x.new_empty(rows, self.dense.shape[0])
        out[:num_low_bit] = self._low_bit(x[:num_low_bit], num_decode)
        out[num_low_bit:] = self._dense(x[num_low_bit:])
        return out

    def _low_bit(self, x: torch.Tensor, num_decode: int) -> torch.Tensor:
        """Low-bit rows, the first `num_decode` of them decode rows: those through the copy's
        decode kernel where it has its own (int8 activations), the others through mm."""
        if num_decode == 0 or not getattr(self.packed, "int8_activations", False):
            return self.packed.mm(x)
        if num_decode >= x.shape[0]:
            return self.packed.decode_mm(x)
        out = x.new_empty(x.shape[0], self.dense.shape[0])
        out[:num_decode] = self.packed.decode_mm(x[:num_decode])
        out[num_decode:] = self.packed.mm(x[num_decode:])
        return out
