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


def _copy_csrc(dest):
    import shutil

    shutil.copytree(cpu_kernels.CSRC, dest)
    return [dest / p.name for p in cpu_kernels.SOURCES]


def test_the_library_name_changes_with_the_sources_and_headers_only(tmp_path):
    """Each version of the code gets a build of its own (the loader rebuilds a name's folder
    in place when its sources differ), and the same code at another path shares one."""
    one = _copy_csrc(tmp_path / "one")
    two = _copy_csrc(tmp_path / "elsewhere" / "csrc")
    tag = cpu_kernels.source_tag(one, tmp_path / "one")
    assert tag == cpu_kernels.source_tag(two, tmp_path / "elsewhere" / "csrc")
    assert tag == cpu_kernels.source_tag()  # this checkout's
    (tmp_path / "one" / "lowbit_matmul.cpp").write_text(
        (tmp_path / "one" / "lowbit_matmul.cpp").read_text() + "\n// changed\n")
    changed_source = cpu_kernels.source_tag(one, tmp_path / "one")
    assert changed_source != tag
    (tmp_path / "one" / "chunks.h").write_text(
        (tmp_path / "one" / "chunks.h").read_text() + "\n// changed\n")
    assert cpu_kernels.source_tag(one, tmp_path / "one") not in (tag, changed_source)


def test_a_cached_build_that_does_not_load_is_built_again(tmp_path, caplog):
    import torch.utils.cpp_extension as cpp_extension

    assert cpu_kernels._import_built(cpp_extension, "zeroserve_cpu_kernels_x", tmp_path) is None
    (tmp_path / "zeroserve_cpu_kernels_x.so").write_bytes(b"\x7fELF cut short by a kill")
    assert cpu_kernels._import_built(cpp_extension, "zeroserve_cpu_kernels_x", tmp_path) is None
    assert "rebuilding" in caplog.text


def test_every_kernel_source_is_in_the_package_data():
    """A wheel (`pip install .`, the Docker image) carries csrc/ for the build at first use:
    a header left out makes every build fail, and the worker runs the slow torch paths."""
    import fnmatch
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads(
        (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["zeroserve.worker"]
    files = sorted(p.relative_to(cpu_kernels.CSRC.parent).as_posix()
                   for p in cpu_kernels.CSRC.iterdir() if p.is_file())
    assert files
    missing = [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
