"""Choosing the device, the compute dtype and the KV cache budget for this worker."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from zeroserve.worker import cpu_class

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# On the CPU the KV pool takes a share of the RAM available at start, never more than this.
CPU_KV_CACHE_FRACTION = 0.25
CPU_KV_CACHE_CAP_BYTES = 4 << 30
# On CUDA it takes this share of the memory still free after the weights are loaded; the rest
# is headroom for activations and the CUDA allocator.
CUDA_KV_CACHE_FRACTION = 0.85


def resolve_device(name: str) -> torch.device:
    """'auto' -> the first CUDA device if there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda:0")
        num_visible = torch.cuda.device_count()
        if device.index >= num_visible:
            # Indices count the GPUs this process sees: in a container given one GPU (or
            # under CUDA_VISIBLE_DEVICES=3) that GPU is cuda:0, whatever its host index.
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ValueError(
                f"device {name!r} asked for, but this process sees {num_visible} CUDA "
                f"device(s) (cuda:0 to cuda:{num_visible - 1})"
                + (f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "")
                + "; indices count visible devices only: use cuda or cuda:0 in a container "
                "given one GPU")
    elif device.type != "cpu":
        raise ValueError(f"unsupported device {name!r} (use auto, cpu or cuda[:N])")
    return device


def cpu_supports_bf16() -> bool:
    """True when the effective CPU class (worker/cpu_class: this CPU, or less under
    ZEROSERVE_CPU_CLASS) has native bf16 dot products (AVX512-BF16 or AMX), where bf16
    matmuls run several times faster than fp32; without them bf16 is emulated and slower."""
    return cpu_class.native_bf16()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype of the activations and the KV cache (resolve_precision's first)."""
    return resolve_precision(name, device)[0]


def resolve_precision(name: str, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(the activations' and KV cache's dtype, the prompt rows' projections' dtype).

    'auto': on CUDA bf16 (fp16 on GPUs without native bf16). On a CPU with native bf16 (in
    the effective CPU class) where the native block kernels build: fp32, with the prompt rows'
    projections in bf16: decode rows run the fp32 block kernels (faster per token there than
    torch's bf16 int4 kernel) and prompt rows the CPU's bf16 GEMM (about twice fp32's rate);
    bf16 throughout where the block kernels cannot be built; fp32 on CPUs without native
    bf16. An explicit name always wins, for both. On the CPU, logs the effective class with
    the choice (once per worker, at its start)."""
    if name != "auto" and name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (use auto, float32, bfloat16, float16)")
    if device.type == "cuda":
        if name != "auto":
            return _DTYPES[name], _DTYPES[name]
        chosen = torch.bfloat16 if cuda_supports_bf16(device) else torch.float16
        return chosen, chosen
    if name != "auto":
        chosen = prompt = _DTYPES[name]
    elif not cpu_supports_bf16():
        chosen = prompt = torch.float32
    else:
        from zeroserve.worker.model.quant import block_kernels_available

        chosen, prompt = ((torch.float32, torch.bfloat16) if block_kernels_available()
                          else (torch.bfloat16, torch.bfloat16))
    logger.info("%s: dtype %s%s%s", cpu_class.effective().describe(), dtype_name(chosen),
                f", prompt projections {dtype_name(prompt)}" if prompt != chosen else "",
                " (auto)" if name == "auto" else "")
    return chosen, prompt


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device,
                     production: bool = False) -> torch.dtype:
    """The KV pool's dtype for --kv-cache-dtype `name` under activations in `dtype`.

    'auto': bfloat16 on the CPU under float32 activations where `production` (`--dtype auto`
    with int8 activations: the default path, whose quality gate ran with a bf16 cache;
    benchmarks/bench_quality.py `auto+kv-bf16`), else the activations' dtype (so `--dtype
    float32` keeps the exact fp32 reference path). An explicit name is either the activations' dtype or, on the CPU, bfloat16 under
    float32 activations: K/V are rounded to bf16 as they are written and widened back to fp32
    (exactly) as attention reads them, half the pool's bytes and half attention's reads."""
    if name == "auto":
        if production and device.type == "cpu" and dtype == torch.float32:
            return torch.bfloat16
        return dtype
    chosen = _DTYPES.get(name)
    if chosen not in (torch.float32, torch.bfloat16):
        raise ValueError(f"unsupported KV cache dtype {name!r} (use auto, float32, bfloat16)")
    if chosen == dtype:
        return chosen
    if device.type == "cpu" and dtype == torch.float32 and chosen == torch.bfloat16:
        logger.info("KV cache in bfloat16 under float32 activations")
        return chosen
    raise ValueError(f"--kv-cache-dtype {name} under {dtype_name(dtype)} activations on "
                     f"{device.type}: a KV cache dtype other than the activations' is "
                     "bfloat16 under float32 on the CPU only")


def cuda_supports_bf16(device: torch.device) -> bool:
    """True on GPUs with bf16 tensor cores (compute capability 8.0, Ampere, and later; all
    ROCm GPUs torch supports). Not torch.cuda.is_bf16_supported(): by default it also counts
    GPUs that only emulate bf16 (T4, V100), far slower than their fp16, and it asks about
    the current device rather than this worker's."""
    if torch.version.hip:
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def available_cpu_memory(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes of RAM that can be had without swapping: the kernel's MemAvailable, and no more
    than this process's memory cgroup still allows (a container's limit, which MemAvailable
    does not see: a pool sized from the host's memory ends in an OOM kill as it fills)."""
    available = None
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    room = cgroup_memory_room(cgroup_root)
    return available if room is None else min(available, room)


def cgroup_memory_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes left under this process's cgroup memory limit (v2 memory.max, or v1
    memory.limit_in_bytes), None where there is no limit or no cgroup to read."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes",
                                    "memory/memory.usage_in_bytes")):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 60:  # "max", or v1's "no limit"
            return None
        return max(int(limit) - usage, 0)
    return None


def default_kv_cache_bytes(device: torch.device) -> int:
    """The KV budget when the operator gave none; call after the weights are loaded."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * CUDA_KV_CACHE_FRACTION)
    return min(int(available_cpu_memory() * CPU_KV_CACHE_FRACTION), CPU_KV_CACHE_CAP_BYTES)
