"""The native kernel's build cache: keyed by the CPU it was built for (-march=native), and safe
from a build killed half-way."""

from __future__ import annotations

from zeroserve.worker import cpu_kernels
from zeroserve.worker.cpu_kernels import cpu_tag

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma
bogomips\t: 4899.99

processor\t: 1
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx avx2 fma avx512f
"""


def test_the_tag_changes_with_the_cpu_features_only():
    tag = cpu_tag(EPYC)
    assert tag == cpu_tag(EPYC.replace("4899.99", "4901.00"))  # clock noise: same CPU
    assert tag == cpu_tag(EPYC.replace("avx avx2", "avx2 avx"))  # flag order
    assert tag != cpu_tag(EPYC.replace("avx2 fma\n", "avx2 fma avx512f avx512_bf16\n", 1))
    assert tag != cpu_tag(EPYC.replace("EPYC 7B13", "EPYC 9B14"))
    assert len(tag) == 12 and tag.isalnum()
    assert cpu_tag() == cpu_tag()  # this machine's


def test_a_build_killed_half_way_does_not_hang_the_next_start(tmp_path):
    """torch's loader waits forever on a `lock` file that a killed builder left behind; with
    the builders' flock held (which dies with its holder), such a file is known stale and
    removed before the loader runs. A second process waits on the flock meanwhile."""
    import fcntl
    import subprocess
    import sys

    build_dir = tmp_path / "zeroserve_cpu_kernels_x"
    build_dir.mkdir()
    (build_dir / "lock").touch()  # what a SIGKILLed build leaves
    with cpu_kernels._builders_lock(build_dir):
        assert not (build_dir / "lock").exists()
        probe = subprocess.run(
            [sys.executable, "-c",
             "import fcntl, sys; f = open(sys.argv[1], 'a'); "
             "fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)",
             str(tmp_path / "zeroserve_cpu_kernels_x.flock")],
            capture_output=True, text=True)
        assert probe.returncode != 0 and "BlockingIOError" in probe.stderr  # held
    with open(tmp_path / "zeroserve_cpu_kernels_x.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
