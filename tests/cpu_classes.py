"""Run a numeric test under each CPU class this machine can provide (worker/cpu_class).

oneDNN and ATen read their instruction-set caps once, when torch loads, so a class other than
the test process's own runs in a fresh interpreter with `ZEROSERVE_CPU_CLASS` set (the
subprocess's conftest, or `apply_to_environment` in `call`, sets the caps before torch).
Classes above this machine are skipped: they would run as the machine's own class, and their
decisions are tested in-process with the capability patched in (tests/worker/test_cpu_class.py).

    @pytest.mark.parametrize("cpu_class", cpu_classes.params())
    def test_greedy_is_the_same_with_speculation(cpu_class):
        with_spec, without = cpu_classes.call(cpu_class, "tests.worker.helpers:greedy_pair")
        assert with_spec == without

    @pytest.mark.slow
    @pytest.mark.parametrize("cpu_class", cpu_classes.params())
    def test_the_kernel_tests_pass(cpu_class):
        cpu_classes.run_pytest(cpu_class, "tests/worker/test_row_ops.py")

`call` returns the function's JSON-encodable result; `run_pytest` fails the calling test with
the subprocess's output when the selected tests fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zeroserve.cli.harness import REPO_ROOT
from zeroserve.worker.cpu_class import ENV_VAR, CpuClass, detected_class

# What `call` runs: the class's caps before torch, then the function, its result as JSON.
_CALL = """
import importlib, json, sys
from zeroserve.worker.cpu_class import apply_to_environment
apply_to_environment()
target, args, kwargs = json.loads(sys.argv[1])
module, _, name = target.partition(":")
result = getattr(importlib.import_module(module), name)(*args, **kwargs)
print("\\n" + json.dumps(result))
"""

ALL = [c.label for c in sorted(CpuClass, reverse=True) if c != CpuClass.BASELINE]


def available() -> list[str]:
    """The classes this machine can run for real, highest first."""
    machine = detected_class()
    return [name for name in ALL if CpuClass[name.upper()] <= machine]


def params() -> list:
    """Every class as a pytest parameter, those above this machine marked skip."""
    machine = detected_class()
    return [pytest.param(name, id=name, marks=() if name in available() else pytest.mark.skip(
        reason=f"CPU class {name} is above this machine's ({machine.label})")) for name in ALL]


def class_env(cpu_class: str) -> dict[str, str]:
    """This process's environment with the class asked for and no caps of another class
    (the subprocess sets its own)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CPP_MARCH")}
    env[ENV_VAR] = cpu_class
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def call(cpu_class: str, target: str, *args, timeout_s: float = 900, **kwargs):
    """`module:function`(*args, **kwargs) in a fresh interpreter under `cpu_class`; its
    result, which must be JSON-encodable."""
    proc = subprocess.run(
        [sys.executable, "-c", _CALL, json.dumps([target, args, kwargs])],
        env=class_env(cpu_class), cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=timeout_s)
    if proc.returncode != 0:
        pytest.fail(f"{target} under CPU class {cpu_class} exited {proc.returncode}:\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.rstrip().rsplit("\n", 1)[-1])


def run_pytest(cpu_class: str, *selection: str, timeout_s: float = 1800) -> str:
    """pytest on `selection` (paths or node ids) under `cpu_class`; its output. Fails the
    calling test where any selected test fails (or none ran)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection],
        env=class_env(cpu_class), cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=timeout_s)
    if proc.returncode != 0:
        pytest.fail(f"pytest {' '.join(selection)} under CPU class {cpu_class} exited "
                    f"{proc.returncode}:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout
