"""What the worker believes about the CPU: one class, capped by the operator, read by all.

The CPU's instruction set decides the compute dtype (`--dtype auto` is bf16 only with native
bf16 dot products), which kernel a projection uses (worker/model), how the native kernels are
compiled (worker/cpu_kernels) and which kernels oneDNN and ATen pick inside torch. A result
that is green on one class can be red on the next, so every one of those decisions reads the
*effective class* here, and `ZEROSERVE_CPU_CLASS` (the worker's `--cpu-class`) caps it:

    amx > avx512_bf16 > avx512_vnni > avx512 > avx2 > baseline

`native` (the default) is what /proc/cpuinfo says. A requested class never claims more than
the machine has: the effective class is min(requested, detected), so on a capable machine
every lower class runs for real and a class above it runs as the machine's own.

oneDNN and ATen read their caps (`ONEDNN_MAX_CPU_ISA`, `ATEN_CPU_CAPABILITY`) once, when torch
loads: `apply_to_environment` sets them and must run before the process's first
`import torch` (the worker command and tests/conftest.py call it first). This module imports
no torch for that reason; only the fallback detection on a system without /proc/cpuinfo
asks torch, late.
"""

from __future__ import annotations

import enum
import logging
import os
import platform
import sys
from collections.abc import Container, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_VAR = "ZEROSERVE_CPU_CLASS"
NATIVE = "native"


class CpuClass(enum.IntEnum):
    """The classes, lowest first: each has everything of the ones below it."""

    BASELINE = 0  # below AVX2 (or not x86): only what the machine's own build gives
    AVX2 = 1  # x86-64-v3: AVX2, FMA, F16C, BMI (most AMD desktops, older Intel servers)
    AVX512 = 2  # x86-64-v4: AVX-512 F, BW, CD, DQ, VL
    AVX512_VNNI = 3  # + AVX512_VNNI (int8 dot products)
    AVX512_BF16 = 4  # + AVX512_BF16 (native bf16 dot products)
    AMX = 5  # + AMX tiles for bf16 and int8

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def has_native_bf16(self) -> bool:
        return self >= CpuClass.AVX512_BF16


# /proc/cpuinfo flags each class needs on top of the one below it.
_NEEDS: dict[CpuClass, frozenset[str]] = {
    CpuClass.AVX2: frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}),
    CpuClass.AVX512: frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    CpuClass.AVX512_VNNI: frozenset({"avx512_vnni"}),
    CpuClass.AVX512_BF16: frozenset({"avx512_bf16"}),
    CpuClass.AMX: frozenset({"amx_tile", "amx_bf16", "amx_int8"}),
}

# oneDNN's cap (its names) and ATen's (torch's dispatch: default, avx2 or avx512) per class.
_ONEDNN_ISA = {
    CpuClass.AVX2: "AVX2",
    CpuClass.AVX512: "AVX512_CORE",
    CpuClass.AVX512_VNNI: "AVX512_CORE_VNNI",
    CpuClass.AVX512_BF16: "AVX512_CORE_BF16",
    CpuClass.AMX: "AVX512_CORE_AMX",
}
_ATEN_CAPABILITY = {CpuClass.AVX2: "avx2"} | {
    c: "avx512" for c in CpuClass if c >= CpuClass.AVX512}

# The compiler's target per class: the x86-64 psABI levels plus the extensions the class has.
_MARCH = {
    CpuClass.AVX2: ["-march=x86-64-v3"],
    CpuClass.AVX512: ["-march=x86-64-v4"],
    CpuClass.AVX512_VNNI: ["-march=x86-64-v4", "-mavx512vnni"],
    CpuClass.AVX512_BF16: ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"],
    # Our kernels use no AMX instruction; the class compiles as its bf16 base.
    CpuClass.AMX: ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"],
}


class CpuClassError(ValueError):
    pass


def names() -> list[str]:
    """The values `ZEROSERVE_CPU_CLASS` / `--cpu-class` accept, highest class first."""
    return [NATIVE, *(c.label for c in sorted(CpuClass, reverse=True) if c != CpuClass.BASELINE)]


def parse(name: str | None) -> CpuClass | None:
    """A class name -> the class; None (or '', 'native') -> None, meaning the machine's own."""
    if name is None or name.strip().lower() in ("", NATIVE):
        return None
    wanted = name.strip().lower().replace("-", "_")
    for cls in CpuClass:
        if cls.label == wanted and cls != CpuClass.BASELINE:
            return cls
    raise CpuClassError(f"unknown CPU class {name!r} (use one of {', '.join(names())})")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str] | None:
    """The first processor's feature flags from /proc/cpuinfo; None without one."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        if not path.is_file():
            return None
        cpuinfo = path.read_text(errors="replace")
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() in ("flags", "features"):  # x86, arm64
            return frozenset(value.split())
    return frozenset()


def class_of_flags(flags: Container[str]) -> CpuClass:
    """The highest class all of whose flags (and its lower classes') the CPU lists."""
    found = CpuClass.BASELINE
    for cls in sorted(_NEEDS):
        if not all(flag in flags for flag in _NEEDS[cls]):
            break
        found = cls
    return found


def _class_from_torch() -> CpuClass:
    """Without /proc/cpuinfo (not Linux): ask torch, which by then has loaded anyway."""
    import torch

    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if probe is not None and probe():
        return CpuClass.AVX512_BF16
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return {"avx512": CpuClass.AVX512, "avx2": CpuClass.AVX2}.get(capability,
                                                                  CpuClass.BASELINE)


def detected_class(flags: Container[str] | None = None) -> CpuClass:
    """This machine's class, from `flags` (this CPU's where None)."""
    if flags is None:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return CpuClass.BASELINE
        flags = cpu_flags()
        if flags is None:
            return _class_from_torch()
    return class_of_flags(flags)


@dataclass(frozen=True)
class Effective:
    """The class the worker acts on: `requested` (None for native) capped by `detected`."""

    requested: CpuClass | None
    detected: CpuClass

    @property
    def cpu_class(self) -> CpuClass:
        if self.requested is None:
            return self.detected
        return min(self.requested, self.detected)

    @property
    def is_native(self) -> bool:
        """Decisions follow the machine's own build (no cap asked for)."""
        return self.requested is None

    @property
    def name(self) -> str:
        """The class's name, as the kernel library's tag and the logs carry it."""
        return NATIVE if self.is_native else self.cpu_class.label

    def describe(self) -> str:
        if self.is_native:
            return f"CPU class {self.cpu_class.label} (native)"
        capped = " (capped: above this machine's)" if self.requested > self.detected else ""
        return (f"CPU class {self.cpu_class.label} ({ENV_VAR}={self.requested.label}{capped}, "
                f"this machine: {self.detected.label})")

    def compiler_flags(self) -> list[str]:
        """-march for the native kernels: the machine's own for native (and below AVX2,
        where the machine is already under every class), the class's ISA otherwise."""
        if self.is_native or self.cpu_class == CpuClass.BASELINE:
            return ["-march=native"]
        return list(_MARCH[self.cpu_class])

    def torch_environment(self) -> dict[str, str]:
        """ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY (which also picks inductor's vector ISA)
        and inductor's -march (TORCHINDUCTOR_CPP_MARCH, else -march=native) for a capped
        class; {} for native. Inductor still adds the VNNI and AMX instructions of its own
        AVX-512 choice where the machine has them: its compiled code (the CPU's compiled
        decode step, off by default) is capped at AVX2 against AVX-512, not finer."""
        cls = self.cpu_class
        if self.is_native or cls == CpuClass.BASELINE:
            return {}
        return {"ONEDNN_MAX_CPU_ISA": _ONEDNN_ISA[cls],
                "ATEN_CPU_CAPABILITY": _ATEN_CAPABILITY[cls],
                "TORCHINDUCTOR_CPP_MARCH": _MARCH[cls][0].removeprefix("-march=")}


def effective(environ: Mapping[str, str] | None = None,
              flags: Container[str] | None = None) -> Effective:
    """The effective class from `environ`'s ZEROSERVE_CPU_CLASS (this process's) and
    `flags` (this CPU's)."""
    env = os.environ if environ is None else environ
    return Effective(parse(env.get(ENV_VAR)), detected_class(flags))


def native_bf16() -> bool:
    """Whether the effective class has native bf16 dot products (AVX512_BF16 or AMX)."""
    return effective().cpu_class.has_native_bf16


def apply_to_environment(environ: MutableMapping[str, str] | None = None,
                         modules: Container[str] | None = None,
                         flags: Container[str] | None = None) -> Effective:
    """Set oneDNN's, ATen's and inductor's caps for the effective class in `environ` (this
    process's, so torch in it and in every child reads them); the class. The class wins over
    caps set by hand (everything must follow one switch). Too late once torch is in
    `modules`: said in a warning, the caps then still reach child processes."""
    env = os.environ if environ is None else environ
    loaded = sys.modules if modules is None else modules
    chosen = effective(env, flags)
    wanted = chosen.torch_environment()
    if wanted and "torch" in loaded and any(env.get(k) != v for k, v in wanted.items()):
        logger.warning("%s asked for after torch loaded: oneDNN and ATen keep this "
                       "process's caps", chosen.describe())
    env.update(wanted)
    return chosen
