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

The build targets the effective CPU class (worker/cpu_class, `ZEROSERVE_CPU_CLASS`): the
x86-64 level and extensions of the class (`-march=x86-64-v3` for avx2, `-march=x86-64-v4` and
the class's VNNI/BF16 for the AVX-512 classes), or `-march=native` for `native`, the default.
The library's name carries the class, so each class has a build of its own. A native build
only runs on CPUs with the builder's instruction set, and the loader keys its cache by name,
not by CPU: a native build's name also carries a tag of this CPU (its model and feature
flags), so a cache shared with another CPU (a network home, a volume, an image built
elsewhere) builds its own copy instead of loading one that dies with SIGILL. The sources
guard every AVX-512 intrinsic (`__AVX512F__`, `__AVX512BF16__`) and run portable loops
without them, so an avx2 build (an AVX2-only CPU, or the class capped) builds and serves:
its block products, norms and SwiGLU are bit for bit the AVX-512 build's, its decode
attention agrees to rounding (measured: 4e-7 in fp32, one bf16 step at head size 128). One
class per process: the library registers torch ops of one namespace.

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

from zeroserve.worker import cpu_class
from zeroserve.worker.cpu_class import CpuClass, Effective

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / "decode_attention.cpp", CSRC / "lowbit_matmul.cpp", CSRC / "lowbit_int8.cpp",
           CSRC / "row_ops.cpp", CSRC / "decode_layers.cpp", CSRC / "module.cpp"]
# -fopenmp: at::parallel_for is inline OpenMP in torch's headers, serial without it. The
# libgomp it links is the one torch already loaded (same soname), so they share one pool.
BASE_FLAGS = ["-O3", "-fopenmp"]


def build_flags(chosen: Effective) -> list[str]:
    """The compiler's flags for the class `chosen`: its -march, between the base flags."""
    return [BASE_FLAGS[0], *chosen.compiler_flags(), *BASE_FLAGS[1:]]


def library_name(chosen: Effective) -> str:
    """The build's name: this CPU's tag where the flags depend on this CPU (-march=native:
    the name native builds always had), the class's name otherwise; then the hash of the
    sources and flags."""
    flags = build_flags(chosen)
    if "-march=native" in flags:
        machine = cpu_tag()
    else:  # the lowest class with these flags: amx compiles as avx512_bf16, one build for both
        machine = min(c for c in CpuClass
                      if build_flags(Effective(c, c)) == flags).label
    return f"zeroserve_cpu_kernels_{machine}_{source_tag(flags=flags)}"


@functools.cache
def process_class() -> Effective:
    """This process's effective CPU class, read once (its environment is set at start)."""
    return cpu_class.effective()


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


def source_tag(sources: list[Path] | None = None, csrc: Path = CSRC,
               flags: list[str] | None = None) -> str:
    """A hash of what the library is built from: the sources, csrc's headers and the flags.
    It goes in the library's name, so each version of the code has a build of its own. (The
    loader keys its build folder by name alone and rebuilds in place when the sources
    differ: two versions on one machine, a rolling upgrade or `bench_commits.py`'s two
    checkouts, would rebuild each other's library, ~45 s, at every start.)"""
    digest = hashlib.sha256()
    for path in [*(SOURCES if sources is None else sources), *sorted(csrc.glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(build_flags(process_class()) if flags is None else flags).encode())
    return digest.hexdigest()[:12]


# The process class's build (or its failure, remembered), once per process.
_BUILDS: dict[Effective, ModuleType | KernelBuildError] = {}


def _build(chosen: Effective) -> ModuleType | KernelBuildError:
    if chosen not in _BUILDS:
        _BUILDS[chosen] = _build_now(chosen)
    return _BUILDS[chosen]


def _build_now(chosen: Effective) -> ModuleType | KernelBuildError:
    """Build the class's library, or load its cached build."""
    from torch.utils import cpp_extension

    _put_pip_ninja_on_path()
    name = library_name(chosen)
    flags = build_flags(chosen)
    logger.info("native CPU kernels for %s: %s (%s)", chosen.describe(), name, " ".join(flags))
    try:
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        with _builders_lock(build_dir):
            built = _import_built(cpp_extension, name, build_dir)
            if built is not None:
                return built
            return cpp_extension.load(
                name=name, sources=[str(p) for p in SOURCES],
                extra_cflags=flags,
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
    """The compiled module for this process's class; None if it cannot be built here and is
    not required."""
    module = _build(process_class())
    if isinstance(module, KernelBuildError):
        if required:
            raise module
        return None
    return module


def loaded() -> ModuleType | None:
    """The module if this process has already loaded it (never builds or waits for a build)."""
    module = _BUILDS.get(process_class())
    return None if isinstance(module, KernelBuildError) else module
