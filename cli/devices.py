"""Which devices `serve`'s local workers get: the GPUs this process may use, counted without
importing torch (the supervisor stays light), and one device per worker."""

from __future__ import annotations

import os
import shutil
import subprocess

import click


def count_cuda_devices() -> int:
    """GPUs this process may use, without importing torch (the supervisor stays light)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def worker_devices(device: str, num_workers: int | None, num_gpus: int) -> list[str]:
    """One device per local worker: auto -> cuda:i when there are GPUs, else the CPU."""
    if num_workers is None:
        num_workers = max(1, num_gpus) if device in ("auto", "cuda") else 1
    if device == "auto":
        device = "cuda" if num_gpus else "cpu"
    if device == "cuda":
        if num_gpus == 0:
            raise click.UsageError("--device cuda asked for, but no CUDA device is visible")
        return [f"cuda:{i % num_gpus}" for i in range(num_workers)]
    return [device] * num_workers
