"""The native per-row ops of the fp32 CPU path (worker/csrc/row_ops.cpp) against torch's:
RMSNorm (to rounding), the residual add (exact), rotary (bit for bit, as HF computes it),
and the KV write (the same pool as index_copy_, and a slot outside the pool refused)."""

from __future__ import annotations

import pytest
import torch

from zeroserve.worker import cpu_kernels
from zeroserve.worker.model.row_ops import NativeRowOps, TorchRowOps, apply_rotary


@pytest.fixture(scope="module")
def native():
    return NativeRowOps(cpu_kernels.load(required=True))


def hf_rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows,width", [(1, 576), (5, 64), (70, 100)])
def test_rms_norm_matches_hf_and_is_per_row(native, rows, width):
    gen = torch.Generator().manual_seed(rows)
    x, delta = torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)
    weight = torch.randn(width, generator=gen)
    out = native.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, hf_rms_norm(x, weight, 1e-5), rtol=2e-6, atol=2e-6)
    assert torch.equal(torch.cat([native.rms_norm(x[i:i + 1], weight, 1e-5) for i in range(rows)]),
                       out)
    total, normed = native.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, native.rms_norm(x + delta, weight, 1e-5))
    torch_total, torch_normed = TorchRowOps().add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(torch_total, total)
    torch.testing.assert_close(normed, torch_normed, rtol=2e-6, atol=2e-6)


def test_rotary_is_bit_for_bit_hfs(native):
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(6, 15 * 64, generator=gen)
    qk = qkv[:, : 12 * 64].view(6, 12, 64)  # a strided view, as the layer passes it
    cos, sin = torch.randn(6, 1, 64, generator=gen), torch.randn(6, 1, 64, generator=gen)
    assert torch.equal(native.rotary(qk, cos, sin), apply_rotary(qk, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_what_index_copy_stores(dtype):
    module = cpu_kernels.load(required=True)
    gen = torch.Generator().manual_seed(1)
    k_pool, v_pool = torch.zeros(8, 4, 3, 16, dtype=dtype), torch.zeros(8, 4, 3, 16, dtype=dtype)
    qkv = torch.randn(5, 9 * 16, generator=gen).to(dtype)
    k, v = qkv[:, 48:96].view(5, 3, 16), qkv[:, 96:].view(5, 3, 16)
    slots = torch.tensor([0, 7, 31, 12, 13])
    module.write_kv(k_pool, v_pool, k, v, slots)
    k_ref, v_ref = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    k_ref.view(-1, 3, 16).index_copy_(0, slots, k)
    v_ref.view(-1, 3, 16).index_copy_(0, slots, v)
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)
    with pytest.raises(IndexError):
        module.write_kv(k_pool, v_pool, k[:1], v[:1], torch.tensor([32]))
    assert torch.equal(k_pool, k_ref)  # nothing written


def test_silu_mul_matches_torch_to_rounding(native):
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(9, 2 * 200, generator=gen) * 6  # tails of the sigmoid both ways
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -87.5])
    expected = TorchRowOps().silu_mul(gate_up)
    out = native.silu_mul(gate_up)
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)
    assert torch.equal(native.silu_mul(gate_up[3:4]), out[3:4])
