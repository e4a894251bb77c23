"""The int8-activation block kernels (worker/csrc/lowbit_int8.cpp) that decode rows take with
`--int8-activations`: x quantized per row and block of 32 (llama.cpp's Q8_1), integer dot
products with the file's Q4 / Q8_0 blocks, each row independent of its batch, the same bits on
every CPU class, and refusing inputs they cannot read."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from tests import cpu_classes
from tests.worker.test_lowbit_matmul import half_exact, q4_blocks, q8_blocks
from zeroserve.worker import cpu_class, cpu_kernels
from zeroserve.worker.model.quant import BlockQ4, BlockQ8, Int4Blocks, Int8Blocks


@pytest.fixture(scope="module")
def kernels():
    cpu_kernels.load(required=True)


def int8_q8_blocks(rows: int, cols: int, seed: int = 0) -> Int8Blocks:
    """Q8_0 blocks whose values reach both ends of int8, -128 included."""
    blocks = half_exact(q8_blocks(rows, cols, seed))
    blocks.q[:, ::7] = -128
    blocks.q[:, 3::7] = 127
    return blocks


def packed(kind: str, rows: int, cols: int, seed: int = 0) -> BlockQ4 | BlockQ8:
    """A matrix of file-like blocks (fp16-exact scales), its decode rows on int8."""
    if kind == "q4":
        matrix = BlockQ4(BlockQ4.tensors(half_exact(q4_blocks(rows, cols, seed))), rows)
    else:
        matrix = BlockQ8(BlockQ8.tensors(int8_q8_blocks(rows, cols, seed)), rows)
    matrix.use_int8_activations()
    return matrix


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per row and block of 32, d = max|x| / 127 and
    round(x * (1 / d)) * d (half to even), in float64."""
    rows, cols = x.shape
    xb = x.view(rows, cols // 32, 32)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round((xb * inverse).clamp(-127, 127))
    return (q.double() * d.double()).view(rows, cols)


def weights(matrix: BlockQ4 | BlockQ8) -> torch.Tensor:
    """[out, in] float64: the values the blocks hold."""
    if isinstance(matrix, BlockQ4):
        return matrix.dequantize().double()
    panels, blocks, _ = matrix.data.shape
    q = matrix.data[..., :512].contiguous().view(torch.int8).view(panels, blocks, 32, 16)
    q = q.permute(0, 3, 1, 2).reshape(panels * 16, blocks, 32).double()
    scale = matrix.data[..., 512:].contiguous().view(torch.float16).double()
    scale = scale.view(panels, blocks, 16).permute(0, 2, 1).reshape(panels * 16, blocks, 1)
    return (q * scale).reshape(panels * 16, -1)[: matrix.out_features]


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_decode_rows_are_the_product_of_the_int8_rows_and_the_blocks(kernels, kind, rows):
    """What the int8 path computes: each block of x rounded to 255 levels of its largest
    value, times the file's weights; the integer sums are exact, so only fp32 rounding of
    per-block partial sums separates it from the float64 product."""
    matrix = packed(kind, 200, 576)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(1))
    expected = (quantized_rows(x) @ weights(matrix).t()).float()
    out = matrix.decode_mm(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # and they are not the fp32-activation product, which prompt rows keep taking
    assert not torch.equal(out, matrix.mm(x))


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_int8_rows_stay_close_to_the_fp32_activation_product(kernels, kind):
    """Rounding x to 8 bits per block of 32 costs at most half a level (max|x| / 254) per
    input: outputs within a percent of the largest output."""
    matrix = packed(kind, 300, 1536)
    x = torch.randn(16, 1536, generator=torch.Generator().manual_seed(2))
    reference = matrix.mm(x)
    error = (matrix.decode_mm(x) - reference).abs().max().item()
    assert error < 0.01 * reference.abs().max().item()


def test_a_block_of_zeros_and_a_row_of_zeros(kernels):
    """A block whose inputs are all zero has scale 0 and adds nothing (no division by zero);
    an all-zero row gives zero outputs."""
    for kind in ("q4", "q8"):
        matrix = packed(kind, 40, 128)
        x = torch.randn(2, 128, generator=torch.Generator().manual_seed(3))
        x[0, 32:64] = 0
        x[1] = 0
        out = matrix.decode_mm(x)
        expected = (quantized_rows(x) @ weights(matrix).t()).float()
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[1], torch.zeros(40))


def test_a_rows_result_does_not_depend_on_its_batch(kernels):
    """Every row bit-identical alone and among 1..20 others (tiles of 1..8 rows, panels in
    groups of 4, 2 or 1, a partial last tile), for both kernels, on more panels than one
    chunk of work."""
    x = torch.randn(20, 576, generator=torch.Generator().manual_seed(4))
    for matrix in (packed("q4", 700, 576), packed("q8", 700, 576)):
        alone = torch.cat([matrix.decode_mm(x[i:i + 1]) for i in range(20)])
        for rows in (2, 3, 4, 5, 7, 8, 9, 17, 20):
            assert torch.equal(matrix.decode_mm(x[:rows]), alone[:rows]), rows
        assert torch.equal(matrix.decode_mm(x[5:12]), alone[5:12])


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_fp16_scales_give_the_same_outputs_as_fp32_ones(kernels, kind):
    blocks = half_exact(q4_blocks(100, 576) if kind == "q4" else q8_blocks(100, 576))
    cls = BlockQ4 if kind == "q4" else BlockQ8
    half = cls.tensors(blocks)
    blocks.scale[0, 0] = np.float32(0.01) + np.float32(1e-9)  # fp32 storage for the matrix
    full = cls.tensors(blocks)
    assert half.shape[2] < full.shape[2]
    module = cpu_kernels.load(required=True)
    kernel = module.q4_matmul_i8 if kind == "q4" else module.q8_matmul_i8
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(5))
    for rows in (1, 3, 11):
        a, b = kernel(x[:rows], half, 100), kernel(x[:rows], full, 100)
        assert torch.equal(a[:, 1:], b[:, 1:]), rows  # feature 0 has the changed scale


def test_the_kernels_refuse_what_they_cannot_read(kernels):
    module = cpu_kernels.load(required=True)
    q4 = BlockQ4.tensors(q4_blocks(16, 64))
    with pytest.raises(RuntimeError, match="columns"):
        module.q4_matmul_i8(torch.randn(2, 32), q4, 16)
    with pytest.raises(RuntimeError, match="float32"):
        module.q4_matmul_i8(torch.randn(2, 64).bfloat16(), q4, 16)
    with pytest.raises(RuntimeError, match="panels"):
        module.q4_matmul_i8(torch.randn(2, 64), q4, 17)
    with pytest.raises(RuntimeError, match="uint8"):
        module.q8_matmul_i8(torch.randn(2, 64), q4, 16)
    q8 = BlockQ8.tensors(q8_blocks(16, 64))
    assert module.q8_matmul_i8(torch.randn(0, 64), q8, 16).shape == (0, 16)


def test_the_operators_trace_for_a_compiled_step(kernels):
    matrix = packed("q4", 64, 64)
    x = torch.randn(3, 64)
    assert torch.equal(torch.ops.zeroserve.q4_matmul_i8(x, matrix.data, 64), matrix.decode_mm(x))
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fake = torch.ops.zeroserve.q8_matmul_i8(torch.empty(5, 64),
                                                torch.empty(4, 2, 544, dtype=torch.uint8), 60)
    assert fake.shape == (5, 60)


def test_the_compiled_step_calls_the_int8_kernels(kernels):
    """A compiled decode step (worker/model/segments.py) computes decode rows with int8
    activations where the copy has them on, as the eager step does."""
    from zeroserve.worker.model.linear import Linear
    from zeroserve.worker.model.segments import decode_rows, linear_tensors

    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8))
    for kind in ("q4", "q8"):
        matrix = packed(kind, 48, 64)
        tensors = linear_tensors(Linear(weights(matrix).float(), matrix))
        assert tensors[1] == f"{kind}_i8"
        assert torch.equal(decode_rows(x, tensors), matrix.decode_mm(x))


def extreme_matrices() -> tuple[torch.Tensor, BlockQ4, BlockQ8]:
    """The largest integer sums a block can have: q4 weights all 15, q8 weights all -128 or
    127, times activations that quantize to +-127 in every position (constant blocks of each
    sign, and alternating signs)."""
    cols = 256
    ones = np.ones((32, cols // 32), np.float32)
    q4 = BlockQ4(BlockQ4.tensors(Int4Blocks(np.full((32, cols), 15, np.uint8), ones / 64,
                                            ones / 8)), 32)  # w = 15 / 64
    q8_values = np.full((32, cols), -128, np.int8)
    q8_values[16:] = 127
    q8 = BlockQ8(BlockQ8.tensors(Int8Blocks(q8_values, ones / 64)), 32)
    for matrix in (q4, q8):
        matrix.use_int8_activations()
    x = torch.ones(4, cols)
    x[1] = -1
    x[2, ::2] = -1
    x[3, :128] = -1
    return x, q4, q8


def test_the_largest_block_sums_are_exact(kernels):
    """Sums at the integer limits of every class's arithmetic (VNNI's int32 sums here; the
    16-bit pairs of AVX-512 without VNNI run the same inputs in outputs_digest): the exact
    product of the quantized rows and the weights."""
    x, q4, q8 = extreme_matrices()
    for matrix in (q4, q8):
        expected = (quantized_rows(x) @ weights(matrix).t()).float()
        torch.testing.assert_close(matrix.decode_mm(x), expected, rtol=1e-6, atol=1e-6)
    assert torch.allclose(q4.decode_mm(x)[0], torch.full((32,), 256 * 15 / 64))


def outputs_digest() -> str:
    """A hash of both kernels' outputs on fixed inputs at 1, 4 and 16 rows, and on the largest
    block sums (run under each CPU class by the test below)."""
    cpu_kernels.load(required=True)
    digest = hashlib.sha256()
    x = torch.randn(16, 1536, generator=torch.Generator().manual_seed(6))
    x[3, 64:96] = 0  # a block of zeros
    for kind in ("q4", "q8"):
        matrix = packed(kind, 100, 1536, seed=7)
        for rows in (1, 4, 16):
            digest.update(matrix.decode_mm(x[:rows]).numpy().tobytes())
    extreme_x, *extreme = extreme_matrices()
    for matrix in extreme:
        for rows in (1, 4):
            digest.update(matrix.decode_mm(extreme_x[:rows]).numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("requested", [p for p in cpu_classes.params()
                                       if p.id in ("avx512_vnni", "avx512", "avx2")])
def test_every_cpu_class_computes_the_same_bits(requested):
    """The integer sums are exact and the fp32 operations the same on every path: VNNI's
    dpbusd with the two-step transpose (avx512_vnni: no VBMI), AVX-512's 16-bit multiply-adds
    (avx512) and the portable loops (avx2) give the outputs of this machine's own build bit
    for bit. Each class's first build takes minutes."""
    if cpu_class.detected_class().label == requested:
        pytest.skip("this machine's own class: nothing to compare")
    assert cpu_classes.call(requested, "tests.worker.test_lowbit_int8:outputs_digest") == (
        outputs_digest())
