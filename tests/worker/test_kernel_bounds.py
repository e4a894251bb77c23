"""The native decode kernel checks what it is given: a context longer than its block table,
a block id outside the pool or a zero/negative context length raise a Python error before
any read, never read out of bounds or return NaN."""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_attention import make_problem, reference
from zeroserve.worker import cpu_kernels


@pytest.fixture(scope="module")
def kernel():
    return cpu_kernels.load(required=True).decode_attention


def problem(dtype=torch.float32):
    # Two rows of 20 and 40 positions over blocks of 16: tables are [2, 3] wide.
    return make_problem(4, 2, 64, [20, 40], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_context_longer_than_its_block_table_is_refused(kernel, dtype):
    q, k_cache, v_cache, tables, lens = problem(dtype)
    lens[0] = tables.shape[1] * k_cache.shape[1] + 1  # one position past the table
    with pytest.raises(ValueError, match="context length 49 .* 3 blocks of 16"):
        kernel(q, k_cache, v_cache, tables, lens, 0.125)


def test_a_block_id_outside_the_pool_is_refused(kernel):
    q, k_cache, v_cache, tables, lens = problem()
    num_blocks = k_cache.shape[0]
    for bad in (num_blocks, -1):
        bad_tables = tables.clone()
        bad_tables[1, 1] = bad
        with pytest.raises(IndexError, match=f"block id {bad} .* {num_blocks} blocks"):
            kernel(q, k_cache, v_cache, bad_tables, lens, 0.125)


def test_padding_past_the_context_is_never_checked_or_read(kernel):
    """Table entries past a row's context are padding: any value there is fine."""
    q, k_cache, v_cache, tables, lens = problem()
    padded = tables.clone()
    padded[0, 2] = 10**9  # row 0 (20 positions) uses blocks 0 and 1 only
    torch.testing.assert_close(kernel(q, k_cache, v_cache, padded, lens, 0.125),
                               reference(q, k_cache, v_cache, tables, lens, 0.125),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [0, -3])
def test_an_empty_or_negative_context_is_refused(kernel, length):
    q, k_cache, v_cache, tables, lens = problem()
    lens[1] = length
    with pytest.raises(ValueError, match=f"context length {length}"):
        kernel(q, k_cache, v_cache, tables, lens, 0.125)


def test_mismatched_pools_and_heads_are_refused(kernel):
    q, k_cache, v_cache, tables, lens = problem()
    with pytest.raises(RuntimeError, match="k_cache and v_cache"):
        kernel(q, k_cache, v_cache[:-1], tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="head shapes"):
        kernel(q[:, :3], k_cache, v_cache, tables, lens, 0.125)
    empty_pool = k_cache[:0]
    with pytest.raises(IndexError, match="0 blocks"):
        kernel(q, empty_pool, empty_pool, tables, lens, 0.125)
