"""scripts/setup and pyproject agree on the oldest Python, and setup refuses an older one
with a message instead of building a .venv that fails later (asyncio.timeout is 3.11)."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_says_311_for_pip_and_ruff():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == ">=3.11"
    assert project["tool"]["ruff"]["target-version"] == "py311"


def test_setup_refuses_python_310_with_a_clear_message(tmp_path):
    fake = tmp_path / "python3.10"
    fake.write_text("#!/bin/sh\n"
                    'case "$*" in *version_info*) exit 1;; *python_version*) echo 3.10.14;; esac\n'
                    "exit 0\n")
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    result = subprocess.run([str(ROOT / "scripts" / "setup")], capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake),
                                 "ZEROSERVE_VENV": str(venv)}, timeout=60)
    assert result.returncode == 1
    assert "needs Python 3.11 or later" in result.stderr and "3.10.14" in result.stderr
    assert not venv.exists()
