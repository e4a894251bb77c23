"""Whether a dense projection computes each row on its own on this machine, and how to make it.

Batch independence (docs/architecture.md) needs every row of a projection to come out the same
whatever else shares its call: a failed-over stream resumes exactly, a seeded sample does not
change with the load. The low-bit decode kernels compute row by row. oneDNN's dense bf16 GEMM
does too on CPUs with native bf16 (AVX512_BF16, AMX), but not on CPUs without it, where it
converts and blocks the rows by how many there are: a row's result then depends on the number
of rows in its call (seen here: the first 20 of 33 rows differ from the same 20 rows alone).

`dense_tile_rows` answers once per process by computing a few row counts on random data. A
machine whose kernel is row-independent gets None (one call per projection, as before); one
whose kernel is not gets a tile size T: the dense path of a projection that has a low-bit copy
for its decode rows (worker/model/linear.py) then always runs calls of exactly T rows (the last
one padded), so every prefill row sees the same kernel, and it is checked that this holds.
Measured on such a CPU: 1.06x the time of a prefill-heavy batch (docs/benchmarks.md).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

TILE_ROWS = 128
# Row counts that differ in their blocking on the kernels seen (below and above 16, 32, 64).
_PROBE_ROWS = (1, 7, 20, 33, 47, 70, 130)
_PROBE_SHAPE = (384, 576)  # [out, in]: the model's small projections' inner size


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """F.linear(x, weight) in calls of exactly `tile_rows` rows. x [rows, in] -> [rows, out]."""
    rows = x.shape[0]
    if rows == tile_rows:
        return F.linear(x, weight)
    pad = (-rows) % tile_rows
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = x.new_empty(x.shape[0], weight.shape[0])
    for start in range(0, x.shape[0], tile_rows):
        out[start:start + tile_rows] = F.linear(x[start:start + tile_rows], weight)
    return out[:rows]


def padded_linear(x: torch.Tensor, weight: torch.Tensor, min_rows: int) -> torch.Tensor:
    """F.linear(x, weight) with x padded by zero rows to at least `min_rows` rows."""
    rows = x.shape[0]
    if rows >= min_rows:
        return F.linear(x, weight)
    return F.linear(torch.cat([x, x.new_zeros(min_rows - rows, x.shape[1])]), weight)[:rows]


def dense_min_rows(dtype: torch.dtype, device: torch.device, in_features: list[int]) -> int:
    """The fewest rows a dense call must have for its rows to come out as in any larger call,
    on this machine, for weights of these input sizes; smaller calls are padded to it (cheap:
    a few rows more). oneDNN and MKL compute one-row (bf16, once the reduction is long
    enough) and up-to-three-row (fp32) products another way than larger ones, so a prompt's
    last token, left alone by a prefix-cache hit, came out other than within the whole prompt
    (measured here: 1 row of bf16 down_proj, K 1536; 1-3 rows of every fp32 projection).
    1 where even single rows agree; CUDA and any machine where no floor up to 16 is enough
    get 1 as well (batch independence then needs tiles, dense_tile_rows)."""
    if device.type != "cpu":
        return 1
    generator = torch.Generator().manual_seed(2)
    for min_rows in _FLOORS:
        if all(_floor_holds(min_rows, dtype, k, generator) for k in sorted(set(in_features))):
            if min_rows > 1:
                logger.info("dense %s calls of fewer than %d rows are padded to %d here, so "
                            "that no row's result depends on how many share its call",
                            dtype, min_rows, min_rows)
            return min_rows
    logger.info("dense %s rows depend on their call's row count here at any floor up to %d",
                dtype, _FLOORS[-1])
    return 1


_FLOORS = (1, 2, 4, 8, 16)


def _floor_holds(min_rows: int, dtype: torch.dtype, in_features: int,
                 generator: torch.Generator) -> bool:
    """Calls of 1 to 24 rows at several offsets (single rows at each), padded to `min_rows`, give the rows that a
    call of 128 gives."""
    weight = torch.randn(256, in_features, generator=generator).to(dtype)
    x = torch.randn(128, in_features, generator=generator).to(dtype)
    whole = F.linear(x, weight)
    # Single rows at every offset: their differences are rare, a few outputs in a thousand.
    calls = [(start, 1) for start in range(len(x))]
    calls += [(start, rows) for start in (0, 3, 9, 50, 77) for rows in range(2, 25)]
    return all(torch.equal(padded_linear(x[start:start + rows].clone(), weight, min_rows),
                           whole[start:start + rows]) for start, rows in calls)


def _is_row_independent(linear, x: torch.Tensor) -> bool:
    """Slices of x at several offsets, computed alone, give the rows they give inside the
    whole call (a row's result depends neither on its neighbours nor on its position)."""
    whole = linear(x)
    return all(torch.equal(linear(x[start:start + rows]), whole[start:start + rows])
               for start in (0, 5, 11) for rows in _PROBE_ROWS)


def dense_tile_rows(dtype: torch.dtype, device: torch.device) -> int | None:
    """None where F.linear is row-independent for `dtype` on `device`, else the tile size that
    makes it so. Only bf16 on the CPU is probed: the path that promises batch independence
    (docs/architecture.md); fp32 and CUDA agree to rounding only, and are left as they are."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(_PROBE_SHAPE, generator=generator).to(dtype)
    x = torch.randn(max(_PROBE_ROWS) + 11, _PROBE_SHAPE[1], generator=generator).to(dtype)
    if _is_row_independent(lambda a: F.linear(a, weight), x):
        return None
    if not _is_row_independent(lambda a: tiled_linear(a, weight, TILE_ROWS), x):
        logger.warning("dense %s projections depend on their batch here, even in tiles of %d "
                       "rows: batch independence does not hold on this machine",
                       dtype, TILE_ROWS)
        return None
    logger.info("dense %s projections depend on the number of rows on this CPU (no native "
                "bf16): prefill rows run in tiles of %d for batch independence",
                dtype, TILE_ROWS)
    return TILE_ROWS
