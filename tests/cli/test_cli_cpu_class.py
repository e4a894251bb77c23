"""`zeroserve worker --cpu-class` (or ZEROSERVE_CPU_CLASS): the worker acts as that CPU class,
at most this machine's, and says so when it starts."""

from __future__ import annotations

import os
import subprocess

import pytest

from zeroserve.cli.harness import REPO_ROOT, zeroserve_argv
from zeroserve.worker.cpu_class import ENV_VAR, CpuClass, detected_class


def run_worker(*args: str, env_class: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in (ENV_VAR, "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
                        "TORCHINDUCTOR_CPP_MARCH")}
    if env_class is not None:
        env[ENV_VAR] = env_class
    # A model that is not there: the worker stops right after choosing its device and dtype.
    argv = zeroserve_argv("worker", "--model", str(REPO_ROOT / "no-such-model.gguf"),
                          "--log-format", "text", *args)
    return subprocess.run(argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)


def test_the_worker_logs_its_class_and_chooses_the_dtype_by_it():
    if detected_class() < CpuClass.AVX2:
        pytest.skip("this machine is below AVX2")
    proc = run_worker("--cpu-class", "avx2", "--device", "cpu")
    assert proc.returncode == 1 and "cannot load the model" in proc.stderr
    assert (f"CPU class avx2 ({ENV_VAR}=avx2, this machine: {detected_class().label}): "
            "dtype float32 (auto)") in proc.stderr


def test_a_class_above_the_machine_is_capped_and_the_flag_wins_over_the_variable():
    machine = detected_class()
    proc = run_worker("--cpu-class", "amx", "--device", "cpu", env_class="avx2")
    assert proc.returncode == 1
    capped = " (capped: above this machine's)" if machine < CpuClass.AMX else ""
    assert f"CPU class {min(machine, CpuClass.AMX).label} ({ENV_VAR}=amx{capped}" in proc.stderr


def test_an_unknown_class_is_a_usage_error():
    proc = run_worker(env_class="avx1024")
    assert proc.returncode == 2
    assert "Invalid value for '--cpu-class'" in proc.stderr and "avx512_bf16" in proc.stderr
