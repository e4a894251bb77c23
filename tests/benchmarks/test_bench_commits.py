"""benchmarks/bench_commits.py without serving: its flags, each layout's launcher, the ratios."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.bench_commits import (
    RELAY_METRICS,
    Run,
    Side,
    launcher_for,
    order,
    paired_ratios,
    parse_args,
    process_tree_cpu_s,
    relay_argv,
    relay_summary,
    relay_table,
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


def make_relay_run(side: str, repeat: int, tok_s: float, us_per_token: float,
                   errors: int = 0) -> Run:
    return Run(side, repeat, relay_summary({"median": {
        "tokens_per_s": tok_s, "steady_tokens_per_s": tok_s * 1.5,
        "gateway_cpu_us_per_token": us_per_token}, "rounds": [
            {"errors": errors, "usage_tokens": 200_000, "cpu_s": {"worker": 1.5}}]}), None)


def test_relay_flags_and_each_sides_command(tmp_path):
    a = parse_args(["85ea403", ".", "--relay", "--relay-rounds", "5", "--relay-streams", "200",
                    "--head-args=--disable-metrics"])
    assert (a.relay, a.relay_rounds, a.relay_streams, a.relay_tokens, a.relay_step_ms) == (
        True, 5, 200, 200, 20.0)
    old = Side("base", "85ea403", (), "c" * 40, tmp_path / "old")
    here = Side("head", ".", a.serve_args + a.head_args)
    argv = relay_argv(old, a, 4321, tmp_path / "out.json")
    assert argv[argv.index("--tree") + 1] == str(tmp_path / "old")  # that commit's servers
    assert argv[argv.index("--streams") + 1:argv.index("--streams") + 2] == ["200"]
    assert argv[argv.index("--rounds") + 1] == "5"
    assert "--no-stamps" in argv  # older workers may not have --fake-stamps
    (tmp_path / "newer" / "cli").mkdir(parents=True)
    (tmp_path / "newer" / "cli" / "worker.py").write_text('@option("--fake-stamps")\n')
    newer = Side("base", "abfe8ec", (), "d" * 40, tmp_path / "newer")
    assert "--no-stamps" not in relay_argv(newer, a, 4321, tmp_path / "out.json")
    here_argv = relay_argv(here, a, 4321, tmp_path / "out.json")
    assert "--tree" not in here_argv  # the working tree: this checkout's servers
    assert "--no-stamps" not in here_argv  # its worker's step period is measured
    assert here_argv[-1] == "--gateway-arg=--disable-metrics"  # head's flag, for its gateway


@pytest.mark.parametrize("argv", [
    ["main", "HEAD", "--relay", "--relay-rounds", "0"],
    ["main", "HEAD", "--relay", "--relay-streams", "0"],
    ["main", "HEAD", "--relay", "--relay-step-ms", "0"],
])
def test_bad_relay_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_a_relay_result_reads_its_medians_and_counts_every_rounds_errors():
    summary = relay_summary({"rounds": [{"errors": 0}, {"errors": 2}, {"errors": 1}],
                             "median": {"tokens_per_s": 30000.0,
                                        "gateway_cpu_us_per_token": 18.5}})
    assert (summary["tokens_per_s"], summary["gateway_cpu_us_per_token"]) == (30000.0, 18.5)
    assert summary["steady_tokens_per_s"] is None  # no window with every stream open
    assert summary["errors"] == 3
    assert summary["worker_cpu_us_per_token"] is None  # the rounds did not say
    worker = relay_summary({"rounds": [
        {"usage_tokens": 200_000, "cpu_s": {"worker": w}} for w in (1.2, 2.0, 1.4)],
        "median": {}})
    assert worker["worker_cpu_us_per_token"] == 7.0  # the median round's 1.4 s / 200,000
    one_round = relay_summary({"tokens_per_s": 25000.0, "errors": 0,
                               "gateway_cpu_us_per_token": 20.0})  # --rounds 1: no median
    assert one_round["tokens_per_s"] == 25000.0
    assert one_round["worker_step_p50_ms"] is None  # a worker without stamps
    assert relay_summary({"rounds": [], "median": {"worker_step_p50_ms": 20.4}})[
        "worker_step_p50_ms"] == 20.4


def test_the_relay_report_gives_paired_ratios_of_tokens_and_gateway_cpu():
    runs = [make_relay_run("base", 0, 30000.0, 20.0), make_relay_run("head", 0, 33000.0, 18.0),
            make_relay_run("head", 1, 20000.0, 25.0), make_relay_run("base", 1, 25000.0, 25.0)]
    summary = summarize(runs, RELAY_METRICS)
    assert summary["tokens_per_s"]["ratios"] == pytest.approx([1.1, 0.8])
    assert summary["gateway_cpu_us_per_token"]["median_ratio"] == pytest.approx(0.95)
    text = relay_table(runs, summary, (Side("base", "85ea403", (), "a" * 40),
                                       Side("head", ".", ())))
    assert "head = . (working tree)" in text
    assert "0.950x (0.900, 1.000)  lower is better" in text
    assert "tokens_per_s" in text and "0.950x (1.100, 0.800)" in text
    assert text.splitlines()[4].split() == ["base", "#0", "30000.0", "45000.0", "20.00",
                                            "7.50", "-", "0"]  # (no step period: no stamps)
    assert "worker_cpu_us_per_token        7.50     7.50    1.000x (1.000, 1.000)" in text
