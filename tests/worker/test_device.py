"""Device and dtype choice, on any machine: CUDA's answers are stood in for where needed."""

from __future__ import annotations

import pytest
import torch

from zeroserve.worker import device as device_mod
from zeroserve.worker.device import resolve_device, resolve_dtype, resolve_precision

CPU = torch.device("cpu")
GPU = torch.device("cuda:0")


def test_auto_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == CPU
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")


def test_cuda_names_resolve_to_an_indexed_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == GPU
    assert resolve_device("cuda") == GPU
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match="unsupported device"):
        resolve_device("mps")


def test_a_cuda_index_beyond_the_visible_devices_fails_clearly(monkeypatch):
    """A container given one GPU sees it as cuda:0, whatever its index on the host."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-3")
    assert resolve_device("cuda") == resolve_device("cuda:0") == GPU
    with pytest.raises(ValueError, match=r"sees 1 CUDA device.*CUDA_VISIBLE_DEVICES='GPU-3'"):
        resolve_device("cuda:1")


@pytest.mark.parametrize("capability,expected", [
    ((9, 0), torch.bfloat16),  # H100
    ((8, 0), torch.bfloat16),  # A100
    ((7, 5), torch.float16),  # T4: bf16 only emulated
    ((7, 0), torch.float16),  # V100
])
def test_auto_dtype_on_cuda_is_bf16_only_where_native(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_dtype("auto", GPU) == expected


def test_an_explicit_dtype_always_wins(monkeypatch):
    monkeypatch.setattr(device_mod, "cpu_supports_bf16", lambda: True)
    assert resolve_precision("float32", CPU) == (torch.float32, torch.float32)
    assert resolve_precision("bfloat16", CPU) == (torch.bfloat16, torch.bfloat16)
    assert resolve_dtype("fp16", GPU) == torch.float16
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int8", CPU)


@pytest.mark.parametrize("native_bf16,block_kernels,expected", [
    # decode rows on the fp32 block kernels, prompt rows at the CPU's bf16 rate
    (True, True, (torch.float32, torch.bfloat16)),
    (True, False, (torch.bfloat16, torch.bfloat16)),  # no compiler: torch's bf16 int4 path
    (False, True, (torch.float32, torch.float32)),  # bf16 emulated: slower than fp32
    (False, False, (torch.float32, torch.float32)),
])
def test_auto_on_the_cpu_picks_by_what_the_cpu_and_the_kernels_can(monkeypatch, native_bf16,
                                                                    block_kernels, expected):
    from zeroserve.worker.model import quant

    monkeypatch.setattr(device_mod, "cpu_supports_bf16", lambda: native_bf16)
    monkeypatch.setattr(quant, "block_kernels_available", lambda: block_kernels)
    assert resolve_precision("auto", CPU) == expected


def test_the_cpu_kv_budget_stays_inside_a_containers_memory_limit(tmp_path):
    """A cgroup limit (a container's --memory) bounds what the default KV pool is sized from:
    /proc/meminfo shows the host's memory, and a pool sized from it fills past the limit."""
    from zeroserve.worker.device import available_cpu_memory, cgroup_memory_room

    (tmp_path / "memory.max").write_text("1073741824\n")  # 1 GiB, v2
    (tmp_path / "memory.current").write_text(str(256 << 20))
    assert cgroup_memory_room(tmp_path) == 768 << 20
    assert available_cpu_memory(tmp_path) <= 768 << 20
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_memory_room(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2 << 30))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(1 << 30))
    assert cgroup_memory_room(v1) == 1 << 30
    assert cgroup_memory_room(tmp_path / "none") is None
