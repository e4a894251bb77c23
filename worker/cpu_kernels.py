"""Native CPU kernels (worker/csrc), compiled on first use for this machine's CPU.

torch's C++ extension loader builds `csrc/decode_attention.cpp` with the system compiler and
ninja into torch's extension cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR),
once per source version and machine (about 15 s on 2 cores); later processes load the cached
library. Concurrent workers share one build through the loader's lock file.

`load()` returns None when the build is impossible here (no compiler, no ninja); callers then
use the pure torch path, which computes the same attention.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "decode_attention.cpp"
# -fopenmp: at::parallel_for is inline OpenMP in torch's headers, serial without it. The
# libgomp it links is the one torch already loaded (same soname), so they share one pool.
FLAGS = ["-O3", "-march=native", "-fopenmp"]


class KernelBuildError(RuntimeError):
    pass


@functools.cache
def _build() -> ModuleType | KernelBuildError:
    """Build (or load the cached build) once per process; a failure is remembered too."""
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            name="zeroserve_decode_attention", sources=[str(SOURCE)], extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"], verbose=False,
        )
    except Exception as exc:  # compiler, ninja or linker missing or failing
        logger.warning("native CPU attention kernel unavailable (%s); using the torch path", exc)
        return KernelBuildError(f"could not build {SOURCE.name}: {exc}")


def load(required: bool = False) -> ModuleType | None:
    """The compiled module; None if it cannot be built here and is not required."""
    module = _build()
    if isinstance(module, KernelBuildError):
        if required:
            raise module
        return None
    return module
