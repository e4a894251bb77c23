"""benchmarks/bench_commits.py without serving: its flags, each layout's launcher, the ratios."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.bench_commits import (
    Run,
    Side,
    launcher_for,
    order,
    paired_ratios,
    parse_args,
    process_tree_cpu_s,
    summarize,
    table,
)


def make_run(side: str, repeat: int, tok_s: float, ttft_ms: float = 100.0,
             cpu_s: float | None = 10.0, tokens: int = 1000) -> Run:
    summary = {"output_throughput": tok_s, "ttft_ms": {"p50": ttft_ms}, "itl_ms": {"p50": 50.0},
               "total_output_tokens": tokens, "failed": 0}
    return Run(side, repeat, summary, cpu_s)


def test_flags_split_per_side_and_checked():
    a = parse_args(["main", "HEAD", "--serve-args=--dtype float32 --max-num-seqs 32",
                    "--head-args=--batch-invariant", "--repeats", "5"])
    assert (a.base, a.head, a.repeats) == ("main", "HEAD", 5)
    assert a.serve_args == ("--dtype", "float32", "--max-num-seqs", "32")
    assert (a.base_args, a.head_args) == ((), ("--batch-invariant",))
    assert (a.concurrency, a.num_prompts, a.output_len) == (16, 48, 128)


@pytest.mark.parametrize("argv", [
    ["main", "HEAD", "--repeats", "0"],
    ["main", "HEAD", "--serve-args=--port 9000"],  # each server gets a free port
    ["main", "HEAD", "--head-args=--model 'unclosed"],
    ["main"],
])
def test_bad_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_the_launcher_follows_the_commits_layout(tmp_path):
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "cli.py").write_text("")
    (tmp_path / "pyproject.toml").write_text('packages = ["common", "worker"]\n')
    before_namespace = launcher_for(tmp_path)  # top-level packages: the checkout on the path
    assert (before_namespace.module, before_namespace.pythonpath) == ("common.cli", (tmp_path,))

    (tmp_path / "pyproject.toml").write_text('package-dir = {"zeroserve.common" = "common"}\n')
    namespaced = launcher_for(tmp_path)
    assert namespaced.module == "zeroserve.common.cli"
    assert namespaced.pythonpath[0] == tmp_path / ".pp"

    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "__main__.py").write_text("")
    assert launcher_for(tmp_path).module == "zeroserve.cli"


def test_repeats_alternate_which_side_goes_first():
    sides = (Side("base", "main", ()), Side("head", "HEAD", ()))
    assert [tuple(s.name for s in order(r, sides)) for r in range(4)] == [
        ("base", "head"), ("head", "base"), ("base", "head"), ("head", "base")]


def test_ratios_are_paired_within_a_repeat_and_the_median_is_reported():
    runs = [make_run("base", 0, 200.0, cpu_s=20.0), make_run("head", 0, 220.0, cpu_s=18.0),
            make_run("head", 1, 150.0), make_run("base", 1, 100.0),  # a slow repeat for both
            make_run("base", 2, 250.0), make_run("head", 2, 250.0)]
    assert paired_ratios(runs, "output_tok_s") == pytest.approx([1.1, 1.5, 1.0])
    summary = summarize(runs)
    tok_s = summary["output_tok_s"]
    assert tok_s["median_ratio"] == pytest.approx(1.1)  # not the ratio of the medians (1.0)
    assert (tok_s["base_median"], tok_s["head_median"]) == (200.0, 220.0)
    assert summary["cpu_ms_per_token"]["ratios"][0] == pytest.approx(0.9)  # 18 vs 20 ms/token
    text = table(runs, summary, (Side("base", "main", (), "a" * 40),
                                 Side("head", "HEAD", ("--x",), "b" * 40)))
    assert "1.100x (1.100, 1.500, 1.000)" in text
    assert "head = HEAD bbbbbbbbb --x" in text


def test_a_repeat_missing_a_side_gives_no_ratio():
    runs = [make_run("base", 0, 200.0), make_run("head", 0, 100.0), make_run("base", 1, 200.0),
            make_run("head", 2, 0.0, cpu_s=None)]
    assert paired_ratios(runs, "output_tok_s") == [0.5]
    assert paired_ratios(runs, "cpu_ms_per_token") == [1.0]
    assert summarize([])["output_tok_s"]["median_ratio"] is None


def test_cpu_time_counts_the_servers_children():
    # A parent that waits while its child burns 0.3 s of CPU and then stays alive: the child's
    # CPU time is the server's too (however loaded the machine, it gets there in the end).
    burn = ("import time\nwhile time.process_time() < 0.3: pass\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"],
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while process_tree_cpu_s(parent.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_tree_cpu_s(parent.pid) >= 0.3
        assert process_tree_cpu_s(os.getpid() + 10**7) == 0.0  # no such process
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
