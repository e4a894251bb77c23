"""Native CPU kernels (worker/csrc), compiled on first use for this machine's CPU.

torch's C++ extension loader builds the sources of `csrc/` (decode attention over the paged
pool; matrix products with the file's 4-bit and 8-bit blocks; a layer's per-row ops; the
Python bindings) with the system compiler and ninja into torch's extension cache
(~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR), once per source version and CPU
(about 45 s on 2 cores; `./scripts/setup` does it); later processes load the cached library.
The library's name carries a hash of the sources (`source_tag`), so each version of the code
keeps a build of its own there.
Concurrent workers share one build through the loader's lock file (and an flock around it,
so that a build killed half-way does not leave later starts waiting forever).

The build uses `-march=native`, so the library only runs on CPUs with the builder's
instruction set. The loader keys its cache by name, not by CPU: the name also
carries a tag of this CPU (its model and feature flags), so a cache shared with another CPU
(a network home, a volume, an image built elsewhere) builds its own copy instead of loading
one that dies with SIGILL.

`load()` returns None when the build is impossible here (no compiler, no ninja); callers then
use the pure torch paths, which compute the same values. `loaded()` never builds: for code
on the hot path that uses the kernels only where start-up already loaded them.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / "decode_attention.cpp", CSRC / "lowbit_matmul.cpp", CSRC / "row_ops.cpp",
           CSRC / "decode_layers.cpp", CSRC / "module.cpp"]
# -fopenmp: at::parallel_for is inline OpenMP in torch's headers, serial without it. The
# libgomp it links is the one torch already loaded (same soname), so they share one pool.
FLAGS = ["-O3", "-march=native", "-fopenmp"]


class KernelBuildError(RuntimeError):
    pass


def cpu_tag(cpuinfo: str | None = None) -> str:
    """A short hash of what `-march=native` depends on: the architecture, the CPU model and
    its feature flags (from /proc/cpuinfo where there is one)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(errors="replace") if path.is_file() else ""
    wanted = ("vendor_id", "cpu family", "model", "model name", "flags", "features",
              "cpu implementer", "cpu part")  # x86 and arm64 spellings
    lines = []
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() in wanted:
            lines.append(f"{name.strip().lower()}:{' '.join(sorted(value.split()))}")
        elif not line.strip() and lines:
            break  # the first processor's block is enough: the others are the same CPU
    text = "\n".join([platform.machine(), *lines])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _put_pip_ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH; a venv that is not activated has pip's ninja
    (a dependency of the project) only in its own bin folder, so add that where PATH has none."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def source_tag(sources: list[Path] | None = None, csrc: Path = CSRC) -> str:
    """A hash of what the library is built from: the sources, csrc's headers and the flags.
    It goes in the library's name, so each version of the code has a build of its own. (The
    loader keys its build folder by name alone and rebuilds in place when the sources
    differ: two versions on one machine, a rolling upgrade or `bench_commits.py`'s two
    checkouts, would rebuild each other's library, ~45 s, at every start.)"""
    digest = hashlib.sha256()
    for path in [*(SOURCES if sources is None else sources), *sorted(csrc.glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(FLAGS).encode())
    return digest.hexdigest()[:12]


@functools.cache
def _build() -> ModuleType | KernelBuildError:
    """Build (or load the cached build) once per process; a failure is remembered too."""
    from torch.utils import cpp_extension

    _put_pip_ninja_on_path()
    name = f"zeroserve_cpu_kernels_{cpu_tag()}_{source_tag()}"
    try:
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        with _builders_lock(build_dir):
            built = _import_built(cpp_extension, name, build_dir)
            if built is not None:
                return built
            return cpp_extension.load(
                name=name, sources=[str(p) for p in SOURCES],
                extra_cflags=FLAGS,
                extra_ldflags=["-fopenmp"], verbose=False,
            )
    except Exception as exc:  # compiler, ninja or linker missing or failing
        logger.warning("native CPU kernels unavailable (%s); using the torch paths", exc)
        return KernelBuildError(f"could not build the native CPU kernels: {exc}")


def _import_built(cpp_extension: ModuleType, name: str, build_dir: Path) -> ModuleType | None:
    """The library already built under this name (which certifies its sources, flags and
    CPU), imported without the loader: the loader would rewrite the build file with these
    sources' paths, and another checkout of the same code (another path) would rebuild it.
    None where there is none, or it does not import (a build killed while linking): the
    loader builds it then."""
    if not (build_dir / f"{name}.so").is_file():
        return None
    try:
        return cpp_extension._import_module_from_library(name, str(build_dir), True)
    except Exception as exc:
        logger.warning("rebuilding the native CPU kernels: the cached build did not load (%s)",
                       exc)
        return None


@contextlib.contextmanager
def _builders_lock(build_dir: Path) -> Iterator[None]:
    """Held around torch's loader, which has its own lock: a `lock` file that the builder
    removes when done, and that every other process waits on, forever. A builder killed
    mid-build (a worker SIGKILLed during its first start) leaves that file behind, and
    every later start would hang on it. This lock is an flock, which the kernel drops with
    its holder, so whoever holds it knows that no live process of ours is building: a
    `lock` file found then is stale, and goes."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / f"{build_dir.name}.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a kernel build that did not finish",
                               stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load(required: bool = False) -> ModuleType | None:
    """The compiled module; None if it cannot be built here and is not required."""
    module = _build()
    if isinstance(module, KernelBuildError):
        if required:
            raise module
        return None
    return module


def loaded() -> ModuleType | None:
    """The module if this process has already loaded it (never builds or waits for a build)."""
    if not _build.cache_info().currsize:
        return None
    return load()
