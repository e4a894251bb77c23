"""The native block kernels (worker/csrc/lowbit_matmul.cpp) that fp32 decode rows use: the
file's Q4 / Q8_0 blocks times x, against the dense product of the same weights, per row
independent of the batch, and refusing inputs they cannot read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zeroserve.worker import cpu_kernels
from zeroserve.worker.model.quant import BlockQ4, BlockQ8, Int4Blocks, Int8Blocks


@pytest.fixture(scope="module")
def kernels():
    cpu_kernels.load(required=True)


def q4_blocks(rows: int, cols: int, seed: int = 0) -> Int4Blocks:
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
    scale = rng.uniform(0.001, 0.02, (rows, cols // 32)).astype(np.float32)
    zero = rng.normal(0, 0.01, (rows, cols // 32)).astype(np.float32)
    return Int4Blocks(q, scale, zero)


def q8_blocks(rows: int, cols: int, seed: int = 0) -> Int8Blocks:
    rng = np.random.default_rng(seed)
    q = rng.integers(-127, 128, (rows, cols), dtype=np.int8)
    return Int8Blocks(q, rng.uniform(0.001, 0.02, (rows, cols // 32)).astype(np.float32))


def dense_q8(blocks: Int8Blocks) -> torch.Tensor:
    q = torch.from_numpy(blocks.q).float()
    scale = torch.from_numpy(blocks.scale).repeat_interleave(32, dim=1)
    return q * scale


@pytest.mark.parametrize("shape", [(96, 64), (200, 576), (33, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_q4_matches_the_dense_product_of_the_file_values(kernels, shape, rows):
    blocks = q4_blocks(*shape)
    packed = BlockQ4(BlockQ4.tensors(blocks), shape[0])
    weight = blocks.dequantize(torch.float32)  # (q - 8) * scale + zero, as the file means it
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(1))
    expected = (x.double() @ weight.double().t()).float()
    torch.testing.assert_close(packed.mm(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.dequantize(), weight, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_q8_matches_the_dense_product_of_the_file_values(kernels, rows):
    blocks = q8_blocks(300, 576)
    packed = BlockQ8(BlockQ8.tensors(blocks), 300)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(2))
    expected = (x.double() @ dense_q8(blocks).double().t()).float()
    # Each output sums 576 products of size ~1 one at a time in fp32: a few units in the last
    # place of the products' scale, where an output that cancels down to ~0.1 shows 1e-5.
    torch.testing.assert_close(packed.mm(x), expected, rtol=1e-5, atol=5e-5)


def test_a_rows_result_does_not_depend_on_its_batch(kernels):
    """Every row bit-identical alone and among 1..20 others (tiles of 8, a partial last one),
    for both kernels and on more output features than one thread takes."""
    x = torch.randn(20, 576, generator=torch.Generator().manual_seed(3))
    for packed in (BlockQ4(BlockQ4.tensors(q4_blocks(700, 576)), 700),
                   BlockQ8(BlockQ8.tensors(q8_blocks(700, 576)), 700)):
        alone = torch.cat([packed.mm(x[i:i + 1]) for i in range(20)])
        for rows in (2, 7, 8, 9, 17, 20):
            assert torch.equal(packed.mm(x[:rows]), alone[:rows]), rows
        assert torch.equal(packed.mm(x[5:12]), alone[5:12])


def half_exact(blocks: Int4Blocks | Int8Blocks) -> Int4Blocks | Int8Blocks:
    """blocks with every scale (and Q4 offset) rounded to fp16, as GGUF files store them."""
    def round16(a: np.ndarray) -> np.ndarray:
        return a.astype(np.float16).astype(np.float32)

    if isinstance(blocks, Int8Blocks):
        return Int8Blocks(blocks.q, round16(blocks.scale))
    scale = round16(blocks.scale)
    return Int4Blocks(blocks.q, scale, round16(blocks.zero - 8 * scale) + 8 * scale)


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_fp16_scales_give_the_same_outputs_as_fp32_ones(kernels, kind):
    """Scales that are exact in fp16 (the file's own) are stored in fp16, fewer bytes to read,
    and give bit for bit what the same values stored in fp32 give, at 1 and several rows."""
    if kind == "q4":
        blocks = half_exact(q4_blocks(100, 576))
        cls = BlockQ4
    else:
        blocks = half_exact(q8_blocks(100, 576))
        cls = BlockQ8
    half = cls.tensors(blocks)
    # One scale that fp16 cannot hold sends the whole matrix to fp32 storage.
    blocks.scale[0, 0] = np.float32(0.01) + np.float32(1e-9)
    full = cls.tensors(blocks)
    per_unit = {"q4": (320, 384), "q8": (544, 576)}[kind]
    assert (half.shape[2], full.shape[2]) == per_unit
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(4))
    for rows in (1, 3, 11):
        a, b = cls(half, 100).mm(x[:rows]), cls(full, 100).mm(x[:rows])
        assert torch.equal(a[:, 1:], b[:, 1:]), rows  # feature 0 has the changed scale
    if kind == "q4":
        torch.testing.assert_close(cls(half, 100).dequantize()[1:],
                                   cls(full, 100).dequantize()[1:], rtol=0, atol=0)


def test_the_kernels_refuse_what_they_cannot_read(kernels):
    module = cpu_kernels.load(required=True)
    q4 = BlockQ4.tensors(q4_blocks(16, 64))
    with pytest.raises(RuntimeError, match="columns"):
        module.q4_matmul(torch.randn(2, 32), q4, 16)
    with pytest.raises(RuntimeError, match="float32"):
        module.q4_matmul(torch.randn(2, 64).bfloat16(), q4, 16)
    with pytest.raises(RuntimeError, match="uint8"):
        module.q4_matmul(torch.randn(2, 64), q4[..., :300].contiguous(), 16)
    with pytest.raises(RuntimeError, match="panels"):
        module.q4_matmul(torch.randn(2, 64), q4, 17)
    with pytest.raises(RuntimeError, match="uint8"):
        module.q4_matmul(torch.randn(2, 64), q4.view(torch.int8), 16)
    q8 = BlockQ8.tensors(q8_blocks(16, 64))
    with pytest.raises(RuntimeError, match="uint8"):
        module.q8_matmul(torch.randn(2, 64), q4, 16)
    assert module.q8_matmul(torch.randn(0, 64), q8, 16).shape == (0, 16)


def test_the_operators_trace_for_a_compiled_step(kernels):
    """torch.ops.zeroserve.* (what the compiled decode step calls) give the eager result and
    have shape functions for tracing."""
    packed = BlockQ4(BlockQ4.tensors(q4_blocks(64, 64)), 64)
    x = torch.randn(3, 64)
    assert torch.equal(torch.ops.zeroserve.q4_matmul(x, packed.data, 64), packed.mm(x))
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fake = torch.ops.zeroserve.q4_matmul(torch.empty(5, 64),
                                             torch.empty(4, 2, 384, dtype=torch.uint8), 60)
    assert fake.shape == (5, 60)
