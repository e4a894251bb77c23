"""One switch, ZEROSERVE_CPU_CLASS, caps what the worker believes about the CPU, and the
dtype choice, the kernel choice, the native kernels' build and torch's oneDNN/ATen caps all
follow it; a class never claims more than the machine has. Classes above this machine are
tested with the capability patched in."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from tests import cpu_classes
from zeroserve.worker import cpu_class, cpu_kernels
from zeroserve.worker.cpu_class import CpuClass, CpuClassError, Effective
from zeroserve.worker.device import cpu_supports_bf16, resolve_dtype, resolve_precision

CPU = torch.device("cpu")

# Flags as /proc/cpuinfo lists them (abridged to what the classes read, plus neighbours that
# must not count: avx_vnni is AVX-VNNI on 256 bits, not AVX512_VNNI).
HASWELL = "fpu sse2 avx avx2 fma f16c bmi1 bmi2 movbe abm xsave"
ALDER_LAKE = HASWELL + " avx_vnni"
SKYLAKE_X = HASWELL + " avx512f avx512dq avx512cd avx512bw avx512vl"
ICE_LAKE = SKYLAKE_X + " avx512_vnni avx512ifma"
COOPER_LAKE = ICE_LAKE + " avx512_bf16"
SAPPHIRE_RAPIDS = COOPER_LAKE + " amx_bf16 amx_tile amx_int8"
MACHINES = {  # flags -> the class they make
    "fpu sse2 sse4_2": CpuClass.BASELINE,
    HASWELL.replace(" fma", ""): CpuClass.BASELINE,
    HASWELL: CpuClass.AVX2,
    ALDER_LAKE: CpuClass.AVX2,
    HASWELL + " avx512f": CpuClass.AVX2,  # AVX512F alone (Knights Landing) is not x86-64-v4
    SKYLAKE_X: CpuClass.AVX512,
    SKYLAKE_X + " avx512_bf16": CpuClass.AVX512,  # bf16 without VNNI: not a class of ours
    ICE_LAKE: CpuClass.AVX512_VNNI,
    COOPER_LAKE: CpuClass.AVX512_BF16,
    SAPPHIRE_RAPIDS: CpuClass.AMX,
    "fp asimd evtstrm aes pmull sha1 sha2 crc32 bf16": CpuClass.BASELINE,  # arm64
}
CLASSES = [c for c in CpuClass if c != CpuClass.BASELINE]
ONEDNN = {CpuClass.AVX2: "AVX2", CpuClass.AVX512: "AVX512_CORE",
          CpuClass.AVX512_VNNI: "AVX512_CORE_VNNI", CpuClass.AVX512_BF16: "AVX512_CORE_BF16",
          CpuClass.AMX: "AVX512_CORE_AMX"}
MARCH = {CpuClass.AVX2: ["-march=x86-64-v3"],
         CpuClass.AVX512: ["-march=x86-64-v4"],
         CpuClass.AVX512_VNNI: ["-march=x86-64-v4", "-mavx512vnni"],
         CpuClass.AVX512_BF16: ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"],
         CpuClass.AMX: ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"]}


def flags_of(text: str) -> frozenset[str]:
    return frozenset(text.split())


@pytest.fixture
def machine(monkeypatch):
    """machine(flags) makes this process believe the CPU lists `flags` (an x86-64 CPU)."""

    def patch(flags: str) -> None:
        monkeypatch.setattr(cpu_class.platform, "machine", lambda: "x86_64")
        monkeypatch.setattr(cpu_class, "cpu_flags", lambda cpuinfo=None: flags_of(flags))

    return patch


@pytest.mark.parametrize("flags,expected", MACHINES.items(), ids=lambda v: str(v)[-24:])
def test_the_machine_class_is_the_highest_whose_flags_it_all_has(flags, expected):
    assert cpu_class.class_of_flags(flags_of(flags)) == expected


def test_the_class_of_cpuinfo_reads_the_flags_line():
    cpuinfo = (f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {ICE_LAKE}\n"
               "bogomips\t: 4000\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_class.class_of_flags(cpu_class.cpu_flags(cpuinfo)) == CpuClass.AVX512_VNNI


@pytest.mark.parametrize("requested", [*CLASSES, None], ids=str)
@pytest.mark.parametrize("flags", MACHINES, ids=lambda v: v[-24:])
def test_a_class_never_claims_more_than_the_machine_has(requested, flags):
    detected = cpu_class.class_of_flags(flags_of(flags))
    env = {} if requested is None else {cpu_class.ENV_VAR: requested.label}
    chosen = cpu_class.effective(env, flags_of(flags))
    assert chosen.cpu_class == (detected if requested is None else min(requested, detected))
    assert chosen.cpu_class <= detected


def test_this_machine_is_never_exceeded():
    detected = cpu_class.detected_class()
    for name in cpu_class.names():
        assert cpu_class.effective({cpu_class.ENV_VAR: name}).cpu_class <= detected
    assert cpu_class.effective({}).cpu_class == detected  # native by default


def test_class_names_are_checked():
    assert cpu_class.parse("AVX512-BF16") == CpuClass.AVX512_BF16
    assert cpu_class.parse("native") is None and cpu_class.parse("") is None
    for bad in ("avx1024", "baseline", "sse"):
        with pytest.raises(CpuClassError, match="use one of native, amx, avx512_bf16"):
            cpu_class.parse(bad)


@pytest.mark.parametrize("requested", CLASSES, ids=str)
def test_each_class_chooses_the_dtype_on_a_machine_that_has_everything(
        requested, machine, monkeypatch, caplog):
    """--dtype auto computes prompt rows in bf16 only for the classes with native bf16 dot
    products, also where the machine has more (fp32 activations, KV and decode rows beside
    them, where the block kernels build); cpu_supports_bf16, which kernel choices read, says
    the same."""
    from zeroserve.worker.model import quant

    machine(SAPPHIRE_RAPIDS)
    monkeypatch.setenv(cpu_class.ENV_VAR, requested.label)
    monkeypatch.setattr(quant, "block_kernels_available", lambda: True)  # built for no class here
    native = requested >= CpuClass.AVX512_BF16
    with caplog.at_level(logging.INFO, logger="zeroserve.worker.device"):
        assert resolve_precision("auto", CPU) == (
            torch.float32, torch.bfloat16 if native else torch.float32)
    assert cpu_supports_bf16() is native
    assert f"CPU class {requested.label} ({cpu_class.ENV_VAR}={requested.label}" in caplog.text
    assert resolve_dtype("float32", CPU) == torch.float32  # an explicit dtype still wins


@pytest.mark.parametrize("requested", CLASSES, ids=str)
def test_a_class_above_the_machine_runs_as_the_machine(requested, machine, monkeypatch):
    machine(SKYLAKE_X)  # AVX-512 without VNNI or bf16
    monkeypatch.setenv(cpu_class.ENV_VAR, requested.label)
    chosen = cpu_class.effective()
    assert chosen.cpu_class == min(requested, CpuClass.AVX512)
    assert resolve_dtype("auto", CPU) == torch.float32
    assert chosen.torch_environment()["ONEDNN_MAX_CPU_ISA"] == ONEDNN[chosen.cpu_class]
    assert "-mavx512bf16" not in cpu_kernels.build_flags(chosen)


def test_native_follows_the_machine(machine, monkeypatch):
    from zeroserve.worker.model import quant

    monkeypatch.delenv(cpu_class.ENV_VAR, raising=False)
    monkeypatch.setattr(quant, "block_kernels_available", lambda: True)
    machine(COOPER_LAKE)
    assert resolve_precision("auto", CPU) == (torch.float32, torch.bfloat16)
    machine(ICE_LAKE)
    assert resolve_precision("auto", CPU) == (torch.float32, torch.float32)
    assert cpu_kernels.build_flags(cpu_class.effective()) == ["-O3", "-march=native", "-fopenmp"]


@pytest.mark.parametrize("requested", CLASSES, ids=str)
def test_each_class_builds_the_kernels_for_its_own_instruction_set(requested):
    chosen = Effective(requested, CpuClass.AMX)
    assert cpu_kernels.build_flags(chosen) == ["-O3", *MARCH[requested], "-fopenmp"]
    assert "-march=native" not in cpu_kernels.build_flags(chosen)
    label = "avx512_bf16" if requested == CpuClass.AMX else requested.label  # the same code
    assert cpu_kernels.library_name(chosen).startswith(f"zeroserve_cpu_kernels_{label}_")


def test_each_class_has_a_build_of_its_own_and_native_is_tagged_with_this_cpu():
    names = {cpu_kernels.library_name(Effective(c, CpuClass.AMX)) for c in CLASSES}
    assert len(names) == len(CLASSES) - 1  # amx compiles as avx512_bf16 (no AMX code of ours)
    native = cpu_kernels.library_name(Effective(None, CpuClass.AMX))
    assert cpu_kernels.cpu_tag() in native and native not in names
    # Below AVX2 the machine is under every class: its own build, tagged with this CPU.
    capped = Effective(CpuClass.AVX2, CpuClass.BASELINE)
    assert cpu_kernels.build_flags(capped) == ["-O3", "-march=native", "-fopenmp"]
    assert cpu_kernels.cpu_tag() in cpu_kernels.library_name(capped)


@pytest.mark.parametrize("requested", CLASSES, ids=str)
def test_each_class_caps_onednn_and_aten_before_torch_loads(requested):
    env = {cpu_class.ENV_VAR: requested.label, "ONEDNN_MAX_CPU_ISA": "ALL"}
    chosen = cpu_class.apply_to_environment(env, modules=set(), flags=flags_of(SAPPHIRE_RAPIDS))
    assert chosen.cpu_class == requested
    assert env["ONEDNN_MAX_CPU_ISA"] == ONEDNN[requested]  # the class wins: one switch
    assert env["ATEN_CPU_CAPABILITY"] == ("avx2" if requested == CpuClass.AVX2 else "avx512")
    # inductor's C++ (--no-enforce-eager): -march of the class's x86-64 level, not native
    assert env["TORCHINDUCTOR_CPP_MARCH"] == MARCH[requested][0].removeprefix("-march=")


def test_native_leaves_torch_alone():
    env = {"ONEDNN_MAX_CPU_ISA": "AVX2"}  # the operator's own, without a class
    chosen = cpu_class.apply_to_environment(env, modules=set(), flags=flags_of(SAPPHIRE_RAPIDS))
    assert chosen.is_native and chosen.cpu_class == CpuClass.AMX
    assert env == {"ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_a_class_asked_for_after_torch_loaded_says_so(caplog):
    env = {cpu_class.ENV_VAR: "avx2"}
    with caplog.at_level(logging.WARNING, logger="zeroserve.worker.cpu_class"):
        cpu_class.apply_to_environment(env, modules={"torch"}, flags=flags_of(HASWELL))
    assert "after torch loaded" in caplog.text
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"  # still for the children


def test_torch_starts_with_the_class_caps_in_a_fresh_process():
    """As the worker command and tests/conftest.py run it: set before torch loads, ATen
    dispatches to the class's kernels (AVX2 here, on any machine with AVX2 or more)."""
    if cpu_class.detected_class() < CpuClass.AVX2:
        pytest.skip("this machine is below AVX2")
    code = ("import sys\n"
            "from zeroserve.worker.cpu_class import apply_to_environment\n"
            "assert 'torch' not in sys.modules\n"
            "print(apply_to_environment().cpu_class.label)\n"
            "import torch\n"
            "print(torch.backends.cpu.get_cpu_capability())\n")
    env = cpu_classes.class_env("avx2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout.split()
    assert out == ["avx2", "AVX2"]


ONEDNN_ISA_SAYS = {  # what oneDNN's verbose mode names as its ISA, per class
    "avx512": "isa:Intel AVX-512 with AVX512BW, AVX512VL, and AVX512DQ extensions",
    "avx512_vnni": "isa:Intel AVX-512 with Intel DL Boost\n",
    "avx512_bf16": "isa:Intel AVX-512 with Intel DL Boost and bfloat16 support\n",
    "amx": "isa:Intel AVX-512 with Intel DL Boost and bfloat16 support and Intel AMX",
}


@pytest.mark.slow
@pytest.mark.parametrize("requested", cpu_classes.params())
def test_onednn_runs_at_most_the_class(requested):
    """A bf16 matrix product in a process started as the class: oneDNN's own words for the
    ISA it runs (AMX, bf16, VNNI or plain AVX-512 kernels); under avx2 torch does not even
    take oneDNN's bf16 path."""
    code = ("from zeroserve.worker.cpu_class import apply_to_environment\n"
            "apply_to_environment()\n"
            "import torch\n"
            "x = torch.randn(64, 256, dtype=torch.bfloat16)\n"
            "torch.nn.functional.linear(x, torch.randn(256, 256, dtype=torch.bfloat16))\n"
            "print('bf16', torch.ops.mkldnn._is_mkldnn_bf16_supported())\n")
    env = {**cpu_classes.class_env(requested), "ONEDNN_VERBOSE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    if requested == "avx2":
        assert "bf16 False" in out and "isa:" not in out
    else:
        assert ONEDNN_ISA_SAYS[requested] in out


@pytest.mark.slow
def test_inductor_compiles_for_avx2_under_the_avx2_class():
    """The compiled decode step's C++ (--no-enforce-eager): inductor's -march and vector ISA
    are the class's, not this machine's (-march=native)."""
    if cpu_class.detected_class() < CpuClass.AVX2:
        pytest.skip("this machine is below AVX2")
    code = ("from zeroserve.worker.cpu_class import apply_to_environment\n"
            "apply_to_environment()\n"
            "from torch._inductor import cpp_builder, cpu_vec_isa\n"
            "print(cpp_builder._get_cpu_arch_cflags('g++'), cpu_vec_isa.pick_vec_isa())\n")
    out = subprocess.run([sys.executable, "-c", code], env=cpu_classes.class_env("avx2"),
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.split() == ["['march=x86-64-v3']", "avx2"]


def test_this_process_runs_as_its_class():
    """Under `ZEROSERVE_CPU_CLASS=... pytest` (conftest sets the caps): torch's own dispatch
    and the native kernels' build are the class's. Natively, the machine's."""
    chosen = cpu_kernels.process_class()
    if chosen.is_native:
        assert chosen.cpu_class == cpu_class.detected_class()
        return
    aten = torch.backends.cpu.get_cpu_capability()
    assert aten == ("AVX2" if chosen.cpu_class == CpuClass.AVX2 else "AVX512")
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == chosen.torch_environment()["ONEDNN_MAX_CPU_ISA"]
    module = cpu_kernels.load()
    if module is not None:
        assert cpu_kernels.library_name(chosen) in module.__file__


# The numeric promises that depend on the CPU class, on tiny models: the same answer alone,
# batched, chunked and from the prefix cache (fp32 and bf16); greedy tokens equal with and
# without speculation; batch independence; every architecture equal to transformers.
PROMISES = ("tests/worker/test_same_answer.py",
            "tests/worker/test_speculative_models.py::test_greedy_tokens_are_the_same_with_speculation",
            "tests/worker/test_batch_invariance.py", "tests/worker/test_architectures.py")
KERNELS = ("tests/worker/test_cpu_kernels.py", "tests/worker/test_lowbit_matmul.py",
           "tests/worker/test_row_ops.py", "tests/worker/test_attention.py",
           "tests/worker/test_kernel_bounds.py")


@pytest.mark.slow
@pytest.mark.parametrize("requested", [p for p in cpu_classes.params()
                                       if p.id != cpu_class.detected_class().label])
def test_the_kernels_and_the_numeric_promises_hold_under_each_lower_class(requested):
    """Each class below this machine's, in a process that runs as the class: the class's
    kernel build against the torch paths on the kernel tests' small inputs (avx2: the
    sources' portable loops, no AVX-512 code at all; avx512: the fp32 intrinsics, bf16 in
    portable loops), and the numeric promises (PROMISES). The machine's own class runs them
    in the suite itself; classes above it skip. Each class's first build takes minutes
    (cached after)."""
    import shutil

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    out = cpu_classes.run_pytest(
        requested, "tests/worker/test_cpu_class.py::test_this_process_runs_as_its_class",
        *KERNELS, *PROMISES, "-m", "not slow")
    assert " passed" in out


def test_the_helper_runs_a_function_as_each_class_this_machine_provides():
    """tests/cpu_classes.py, for numeric tests under every class: a fresh interpreter with
    the class's caps set before anything loads torch; classes above the machine skip."""
    classes = cpu_classes.available()
    assert classes == [c for c in cpu_classes.ALL
                       if CpuClass[c.upper()] <= cpu_class.detected_class()]
    skipped = [p.id for p in cpu_classes.params() if p.marks]
    assert skipped == [c for c in cpu_classes.ALL if c not in classes]
    for name in classes[-1:]:  # the lowest: the one furthest from this process's own
        chosen = CpuClass[name.upper()]
        assert cpu_classes.call(name, "zeroserve.worker.cpu_class:native_bf16") is (
            chosen.has_native_bf16)
        assert cpu_classes.call(name, "os:getenv", "ONEDNN_MAX_CPU_ISA") == ONEDNN[chosen]
