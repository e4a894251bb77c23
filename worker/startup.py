"""Timing a worker's start, phase by phase, for its log line and its HELLO (/health).

Phases (seconds): `boot` (interpreter start to the engine's first line: Python, the CLI,
ZeroMQ), `import` (torch and the model code), `device`, `load_weights` (weight cache hit:
map and verify the file; miss: parse the model file and dequantize), `quantize` (miss only:
fuse, convert, pack), `cache_write` (miss only), `model`, `kv_cache`, `kernel` (the native
attention kernel: load, or build on the first start), `compile` (the compiled decode step,
worker/model/compiled.py: inductor's cached code loaded, or compiled on the first start;
CUDA graphs captured), `total` (process start to engine ready).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class StartupTimer:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.notes: dict[str, str] = {}  # e.g. {"weight_cache": "hit"}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def rounded(self) -> dict[str, float]:
        return {name: round(seconds, 3) for name, seconds in self.phases.items()}


def seconds_since_process_start() -> float | None:
    """How long this process has existed (10 ms resolution); None where /proc cannot say."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime
        now = time.clock_gettime(time.CLOCK_BOOTTIME)  # the clock starttime counts on
        return max(0.0, now - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None
