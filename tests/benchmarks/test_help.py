"""Every maintained benchmark says what it measures in its --help, and has a section in the
performance docs (docs/benchmarking.md), so none is a one-off nobody can find again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = sorted(p for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
# Imported by the others, not run on their own.
LIBRARIES = {"bench_data.py"}


def test_the_benchmarks_folder_holds_the_maintained_set():
    names = {p.name for p in PROGRAMS}
    assert {"bench_serving.py", "compare.py", "bench_commits.py", "bench_gateway_relay.py",
            "bench_restart.py", "build_llama_server.sh"} <= names
    assert not [p.name for p in (ROOT / "scripts").iterdir() if p.name.startswith("bench")]


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_each_benchmark_has_a_section_in_the_docs(program):
    page = (ROOT / "docs" / "benchmarking.md").read_text()
    assert f"benchmarks/{program.name}" in page


@pytest.mark.slow
@pytest.mark.parametrize("program", [p for p in PROGRAMS if p.name not in LIBRARIES],
                         ids=lambda p: p.name)
def test_each_benchmark_says_what_it_measures(program):
    argv = ["bash", str(program)] if program.suffix == ".sh" else [sys.executable, str(program)]
    result = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    # A description beyond the usage line: the first paragraph that is not usage or options.
    paragraphs = [p for p in text.split("\n\n") if p.strip()
                  and not p.lstrip().startswith(("usage:", "options:", "positional arguments:"))]
    assert paragraphs and len(paragraphs[0].split()) >= 6, text[:400]
