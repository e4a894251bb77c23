"""A worker bounds libgomp's spinning before torch loads, unless the operator chose."""

import os
import subprocess
import sys

from zeroserve.worker.omp_env import SPIN_COUNT, bound_omp_spinning


def test_sets_the_spin_count_where_nothing_chose_one():
    env: dict[str, str] = {}
    assert bound_omp_spinning(env, modules=set())
    assert env == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


def test_the_operators_settings_win():
    for name, value in (("GOMP_SPINCOUNT", "300000"), ("OMP_WAIT_POLICY", "active")):
        env = {name: value}
        assert not bound_omp_spinning(env, modules=set())
        assert env == {name: value}


def test_nothing_once_torch_is_loaded():
    env: dict[str, str] = {}
    assert not bound_omp_spinning(env, modules={"torch"})
    assert env == {}


def test_set_before_torch_loads_it_is_in_the_environment_torch_starts_with():
    """In a fresh interpreter, as the `worker` command runs it first: the setting is in the
    environment libgomp reads when torch loads it."""
    code = (
        "import os, sys\n"
        "from zeroserve.worker.omp_env import bound_omp_spinning\n"
        "assert 'torch' not in sys.modules\n"
        "print(bound_omp_spinning())\n"
        "import torch\n"
        "print(os.environ.get('GOMP_SPINCOUNT'))\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    assert out == ["True", str(SPIN_COUNT)]
