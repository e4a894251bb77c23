"""A regression check: serve two commits side by side on the same prompts and report the ratio.

Each commit is checked out into a temporary, detached `git worktree` and served with its own
launcher (`zeroserve.cli`; `zeroserve.common.cli` before the cli/ package; `common.cli` before
the `zeroserve` namespace), one server at a time, with the same flags (`--serve-args`) plus
each side's own (`--base-args`, `--head-args`, so one commit can A/B test a flag). Every
repeat serves both, alternating which goes first, and runs benchmarks/bench_serving.py (this
checkout's copy: the same client, prompts and seed for both) against each; between runs the
server is stopped through cli/harness.py (SIGTERM, then SIGKILL of its process group).

Reported per run: output tokens/s, TTFT p50, ITL p50, and the CPU seconds the server's
processes spent per 1,000 output tokens (less sensitive than wall time to what else the
shared machine runs). The ratios are head / base inside one repeat; the summary is their
median. A JSON result (every run's bench_serving summary) and a short table are written.

    python benchmarks/bench_commits.py main HEAD --concurrency 16 --num-prompts 48 \\
        --output-len 128 --repeats 3
    python benchmarks/bench_commits.py HEAD HEAD --head-args="--no-batch-invariant"

`.` as a revision serves this checkout as it is, uncommitted changes included.

`--relay` measures the gateway's relay instead (issue 36): every repeat runs
benchmarks/bench_gateway_relay.py (this checkout's copy: the same C client and measurement) with
`--worker fake --tree <checkout>` against each side in turn, `--relay-streams` streams of
`--relay-tokens` tokens on the fake backend (`--relay-step-ms` steps), `--relay-rounds` bursts per
server. Reported per run: relayed tokens/s over the whole burst, steady tokens/s (all streams
open) and the gateway's and the fake worker's CPU us per relayed token, each the median of the
run's bursts; the summary is again the median of the paired head/base ratios. `--serve-args`,
`--base-args` and `--head-args` are then flags for `zeroserve gateway`.

    python benchmarks/bench_commits.py 85ea403 main --relay --repeats 3
    python benchmarks/bench_commits.py main . --relay --relay-rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_data import load_chat_samples  # noqa: E402
from benchmarks.bench_serving import BenchConfig, format_summary, run  # noqa: E402
from zeroserve.cli.harness import ServerError, ServerProcess, free_port, get_status  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / ".bench" / "results"
WORKING_TREE = "."  # the revision that means this checkout as it is
PACKAGES = ("common", "gateway", "worker", "cli")  # the folders `zeroserve.*` maps to


@dataclass(frozen=True)
class Side:
    """One of the two servers compared: `name` is "base" or "head"."""

    name: str
    rev: str
    serve_args: tuple[str, ...]
    commit: str = ""  # the full hash; empty for the working tree
    tree: Path | None = None  # the checkout it is served from


@dataclass(frozen=True)
class Launcher:
    """How to run one checkout's `serve`: `python -m module` with these paths importable."""

    module: str
    pythonpath: tuple[Path, ...]
    import_check: str  # a module whose file must lie inside the checkout


@dataclass
class Run:
    side: str
    repeat: int
    summary: dict
    cpu_s: float | None  # CPU seconds of the server's processes during the benchmark

    @property
    def cpu_ms_per_token(self) -> float | None:
        tokens = self.summary.get("total_output_tokens")  # None: a relay run
        return None if self.cpu_s is None or not tokens else self.cpu_s * 1000 / tokens


# -- checkouts ---------------------------------------------------------------------------------


def git(*args: str, cwd: Path = REPO_ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def resolve(rev: str) -> str:
    """The full commit hash of `rev` ("" for the working tree); a clear error if unknown."""
    if rev == WORKING_TREE:
        return ""
    try:
        return git("rev-parse", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"unknown revision {rev!r}: {e.stderr.strip()}") from e


def make_importable(tree: Path) -> None:
    """A `.pp/zeroserve/<package>` symlink per top-level package folder, so that `.pp` on
    PYTHONPATH makes the checkout importable as `zeroserve` (as pyproject's package-dir)."""
    pp = tree / ".pp" / "zeroserve"
    pp.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        link = pp / name
        if (tree / name).is_dir() and not link.exists():
            link.symlink_to(tree / name, target_is_directory=True)


def launcher_for(tree: Path) -> Launcher:
    """The launcher of the layout this checkout has."""
    pythonpath = (tree / ".pp", tree)
    if (tree / "cli" / "__main__.py").is_file():
        return Launcher("zeroserve.cli", pythonpath, "zeroserve.cli")
    if (tree / "common" / "cli.py").is_file():
        pyproject = (tree / "pyproject.toml").read_text() if (tree / "pyproject.toml").is_file() else ""
        if '"zeroserve.common"' in pyproject:
            return Launcher("zeroserve.common.cli", pythonpath, "zeroserve.common.cli")
        return Launcher("common.cli", (tree,), "common.cli")
    raise SystemExit(f"{tree}: no launcher found (neither cli/__main__.py nor common/cli.py)")


def check_importable(launcher: Launcher, tree: Path) -> None:
    """Fail early if the launcher would import some other copy (the venv's installed one)."""
    code = f"import {launcher.import_check} as m; print(m.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=server_env(launcher),
                         capture_output=True, text=True)
    where = Path(out.stdout.strip()).resolve() if out.returncode == 0 else None
    if where is None or tree.resolve() not in where.parents:
        raise SystemExit(f"{launcher.import_check} does not import from {tree}: "
                         f"{out.stdout.strip() or out.stderr.strip()[-500:]}")


def server_env(launcher: Launcher) -> dict[str, str]:
    # Replaces the PYTHONPATH child_env would give (this checkout's).
    return {"PYTHONPATH": os.pathsep.join(str(p) for p in launcher.pythonpath)}


def add_worktree(commit: str, parent: Path) -> Path:
    tree = parent / commit[:12]
    if not tree.exists():
        git("worktree", "add", "--detach", "--quiet", str(tree), commit)
    make_importable(tree)
    return tree


def remove_worktree(tree: Path) -> None:
    try:
        git("worktree", "remove", "--force", str(tree))
    except subprocess.CalledProcessError:
        shutil.rmtree(tree, ignore_errors=True)
        git("worktree", "prune")


# -- serving -----------------------------------------------------------------------------------


class Teardown:
    """What must not outlive the script: the server being measured and the checkouts. On
    SIGTERM or SIGINT it stops and removes them and exits at once (unwinding through the
    benchmark's event loop would not reach the `finally`s promptly)."""

    def __init__(self) -> None:
        self.server: ServerProcess | None = None
        self.trees: list[Path] = []
        self.keep_trees = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)

    def on_signal(self, signum, frame) -> None:
        print(f"signal {signum}: stopping the server and removing the checkouts", flush=True)
        self.run()
        os._exit(128 + signum)

    def run(self) -> None:
        if self.server is not None:
            self.server.stop(timeout_s=10)
            self.server = None
        if not self.keep_trees:
            for tree in self.trees:
                remove_worktree(tree)
            self.trees = []


def wait_ready(server: ServerProcess, timeout_s: float) -> None:
    """/health/ready answers 200; a commit without it (404) is ready when /health is 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise ServerError(f"server exited with {server.process.returncode}",
                              server.log_tail())
        ready = get_status(server.url + "/health/ready")
        if ready == 200 or (ready == 404 and get_status(server.url + "/health") == 200):
            return
        time.sleep(0.25)
    raise ServerError(f"not ready within {timeout_s}s", server.log_tail())


def process_tree_cpu_s(root_pid: int) -> float:
    """utime + stime of `root_pid` and its live descendants (the server and the workers it
    supervises, which run in sessions of their own), in seconds."""
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent pid, CPU seconds)
    ticks = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # The fields after the command name (which may hold spaces and parentheses):
                # [0] state, [1] ppid, ... [11] utime, [12] stime.
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root_pid]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo.extend(children.get(pid, []))
    return total


def serve_and_measure(side: Side, repeat: int, cfg: BenchConfig, samples, log_dir: Path,
                      startup_timeout_s: float, teardown: Teardown) -> Run:
    tree = side.tree or REPO_ROOT
    launcher = launcher_for(tree)
    port = free_port()
    argv = [sys.executable, "-m", launcher.module, "serve", "--port", str(port),
            *side.serve_args]
    print(f"[{side.name} {side.rev} #{repeat}] {shlex.join(argv)}", flush=True)
    server = ServerProcess(argv, port, log_dir / f"{side.name}-{repeat}.log",
                           env=server_env(launcher), cwd=tree)
    teardown.server = server
    try:
        wait_ready(server, startup_timeout_s)
        server.workers()  # remember the worker pids, so stop() can make sure of them
        cpu_before = process_tree_cpu_s(server.process.pid)
        summary = run(replace(cfg, base_url=server.url, label=f"{side.name} {side.rev}"),
                      samples)
        cpu_s = process_tree_cpu_s(server.process.pid) - cpu_before
    finally:
        server.stop(timeout_s=15)
        teardown.server = None
    summary["server_command"] = shlex.join(argv)
    summary["loadavg"] = os.getloadavg()
    print(format_summary(summary), flush=True)
    return Run(side.name, repeat, summary, cpu_s)


# -- the relay (--relay) -------------------------------------------------------------------------

RELAY_BENCH = REPO_ROOT / "benchmarks" / "bench_gateway_relay.py"


def has_fake_stamps(side: Side) -> bool:
    """Whether the side's fake worker takes --fake-stamps (older commits' do not)."""
    tree = side.tree if side.tree is not None else REPO_ROOT
    return any("--fake-stamps" in path.read_text(errors="replace")
               for pattern in ("cli/*.py", "common/cli.py") for path in tree.glob(pattern))


def relay_argv(side: Side, a: argparse.Namespace, port: int, result_json: Path) -> list[str]:
    """bench_gateway_relay.py's command line for one side: that side's gateway and fake worker,
    this checkout's client and measurement; the worker records stamps (its step period) where
    it can."""
    return [sys.executable, str(RELAY_BENCH), "--worker", "fake",
            *(["--tree", str(side.tree)] if side.tree is not None else []),
            "--streams", str(a.relay_streams), "--tokens", str(a.relay_tokens),
            "--step-ms", str(a.relay_step_ms), "--rounds", str(a.relay_rounds),
            "--port", str(port), *([] if has_fake_stamps(side) else ["--no-stamps"]),
            "--result-json", str(result_json),
            *(f"--gateway-arg={arg}" for arg in side.serve_args)]


def relay_summary(result: dict) -> dict:
    """The figures of one bench_gateway_relay.py result: its medians over the rounds (the
    result of one round is its own median)."""
    median = result.get("median", result)
    rounds = result.get("rounds", [result])
    # The worker's too (the fake engine's loop around its simulated forward): the relay's
    # tokens/s is the gateway's and the worker's, on the same cores.
    worker = [r["cpu_s"]["worker"] / r["usage_tokens"] * 1e6 for r in rounds
              if r.get("usage_tokens") and r.get("cpu_s", {}).get("worker") is not None]
    return {"tokens_per_s": median.get("tokens_per_s"),
            "steady_tokens_per_s": median.get("steady_tokens_per_s"),
            "gateway_cpu_us_per_token": median.get("gateway_cpu_us_per_token"),
            "worker_cpu_us_per_token": round(statistics.median(worker), 2) if worker else None,
            # The fake worker's step period (p50, median over the rounds; its stamps').
            "worker_step_p50_ms": median.get("worker_step_p50_ms"),
            "errors": sum(r.get("errors", 0) for r in rounds), "rounds": rounds}


def relay_and_measure(side: Side, repeat: int, a: argparse.Namespace, log_dir: Path) -> Run:
    """One side's relay run (its own gateway and worker, stopped by the relay script)."""
    port = free_port()
    out = log_dir / f"relay-{side.name}-{repeat}.json"
    argv = relay_argv(side, a, port, out)
    print(f"[{side.name} {side.rev} #{repeat}] {shlex.join(argv)}", flush=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"relay-{side.name}-{repeat}.log", "wb") as log:
        done = subprocess.run(argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"the relay benchmark failed for {side.name} ({side.rev}): see "
                         f"{log_dir / f'relay-{side.name}-{repeat}.log'}")
    summary = relay_summary(json.loads(out.read_text()))
    summary["command"] = shlex.join(argv)
    print(f"  tokens/s {_fmt(summary['tokens_per_s'])}, steady "
          f"{_fmt(summary['steady_tokens_per_s'])}, gateway CPU "
          f"{_fmt(summary['gateway_cpu_us_per_token'])} us/token, worker CPU "
          f"{_fmt(summary['worker_cpu_us_per_token'])} us/token, worker step p50 "
          f"{_fmt(summary['worker_step_p50_ms'], 2)} ms, errors {summary['errors']}",
          flush=True)
    return Run(side.name, repeat, summary, None)


RELAY_METRICS = {  # name -> (how to read it from a relay Run, whether higher is better)
    "tokens_per_s": (lambda r: r.summary["tokens_per_s"], True),
    "steady_tokens_per_s": (lambda r: r.summary["steady_tokens_per_s"], True),
    "gateway_cpu_us_per_token": (lambda r: r.summary["gateway_cpu_us_per_token"], False),
    "worker_cpu_us_per_token": (lambda r: r.summary["worker_cpu_us_per_token"], False),
    "worker_step_p50_ms": (lambda r: r.summary.get("worker_step_p50_ms"), False),
}


def relay_table(runs: list[Run], summary: dict, sides: tuple[Side, Side]) -> str:
    lines = [*_side_lines(sides), "",
             f"{'run':<10}{'tok/s':>10}{'steady tok/s':>14}{'gw CPU us/tok':>15}"
             f"{'worker CPU us/tok':>19}{'step p50 ms':>13}{'errors':>8}"]
    for r in runs:
        s = r.summary
        lines.append(f"{r.side + ' #' + str(r.repeat):<10}{_fmt(s['tokens_per_s']):>10}"
                     f"{_fmt(s['steady_tokens_per_s']):>14}"
                     f"{_fmt(s['gateway_cpu_us_per_token'], 2):>15}"
                     f"{_fmt(s['worker_cpu_us_per_token'], 2):>19}"
                     f"{_fmt(s.get('worker_step_p50_ms'), 2):>13}{s['errors']:>8}")
    lines.append("")
    lines.extend(_ratio_lines(summary, RELAY_METRICS, width=26))
    return "\n".join(lines)


def order(repeat: int, sides: tuple[Side, Side]) -> tuple[Side, Side]:
    """Base first in even repeats, head first in odd ones: drift in the machine's load does
    not always favour the same side."""
    return sides if repeat % 2 == 0 else (sides[1], sides[0])


# -- results -----------------------------------------------------------------------------------

METRICS = {  # name -> (how to read it from a Run, whether higher is better)
    "output_tok_s": (lambda r: r.summary["output_throughput"], True),
    "ttft_p50_ms": (lambda r: r.summary["ttft_ms"]["p50"], False),
    "itl_p50_ms": (lambda r: r.summary["itl_ms"]["p50"], False),
    "cpu_ms_per_token": (lambda r: r.cpu_ms_per_token, False),
}


def paired_ratios(runs: list[Run], metric: str, metrics: dict = METRICS) -> list[float]:
    """head / base of `metric`, one per repeat that has both (and a nonzero base)."""
    read = metrics[metric][0]
    by_repeat: dict[int, dict[str, float | None]] = {}
    for r in runs:
        by_repeat.setdefault(r.repeat, {})[r.side] = read(r)
    return [pair["head"] / pair["base"] for _, pair in sorted(by_repeat.items())
            if pair.get("base") and pair.get("head") is not None]


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[Run], metrics: dict = METRICS) -> dict:
    out: dict = {}
    for metric, (read, _) in metrics.items():
        per_side = {side: [v for r in runs if r.side == side and (v := read(r)) is not None]
                    for side in ("base", "head")}
        ratios = paired_ratios(runs, metric, metrics)
        out[metric] = {"base": per_side["base"], "head": per_side["head"],
                       "base_median": median_or_none(per_side["base"]),
                       "head_median": median_or_none(per_side["head"]),
                       "ratios": ratios, "median_ratio": median_or_none(ratios)}
    return out


def _fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _side_lines(sides: tuple[Side, Side]) -> list[str]:
    return [f"{s.name} = {s.rev} {s.commit[:9] or '(working tree)'} {shlex.join(s.serve_args)}"
            for s in sides]


def _ratio_lines(summary: dict, metrics: dict, width: int = 18) -> list[str]:
    lines = [f"{'metric':<{width}}{'base':>9}{'head':>9}{'head/base (median; each repeat)':>36}"]
    for metric, (_, is_higher_better) in metrics.items():
        m = summary[metric]
        each = ", ".join(f"{x:.3f}" for x in m["ratios"])
        lines.append(f"{metric:<{width}}{_fmt(m['base_median'], 2):>9}"
                     f"{_fmt(m['head_median'], 2):>9}"
                     f"    {_fmt(m['median_ratio'], 3)}x ({each})"
                     f"{'' if is_higher_better else '  lower is better'}")
    return lines


def table(runs: list[Run], summary: dict, sides: tuple[Side, Side]) -> str:
    lines = [*_side_lines(sides), "",
             f"{'run':<10}{'tok/s':>9}{'TTFT p50':>10}{'ITL p50':>9}{'CPU ms/tok':>12}"
             f"{'failed':>8}"]
    for r in runs:
        s = r.summary
        lines.append(f"{r.side + ' #' + str(r.repeat):<10}{_fmt(s['output_throughput']):>9}"
                     f"{_fmt(s['ttft_ms']['p50'], 0):>10}{_fmt(s['itl_ms']['p50']):>9}"
                     f"{_fmt(r.cpu_ms_per_token, 2):>12}{s['failed']:>8}")
    lines.append("")
    lines.extend(_ratio_lines(summary, METRICS))
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Serve two commits side by side (alternated, repeated) and report "
                    "head/base ratios.")
    ap.add_argument("base", help="a git revision (e.g. main), or . for this checkout as it is")
    ap.add_argument("head", help="a git revision (e.g. HEAD), or .")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-warmup", type=int, default=2)
    ap.add_argument("--serve-args", default="", help="flags for both servers (one string)")
    ap.add_argument("--base-args", default="", help="more flags for the base server only")
    ap.add_argument("--head-args", default="", help="more flags for the head server only")
    ap.add_argument("--startup-timeout-s", type=float, default=300.0,
                    help="a fresh checkout builds its native kernel on first start")
    ap.add_argument("--result-json", type=Path, default=None,
                    help="default: .bench/results/commits-<time>.json")
    ap.add_argument("--keep-worktrees", action="store_true",
                    help="leave the temporary checkouts (their logs are beside them)")
    relay = ap.add_argument_group(
        "relay", "--relay: the gateway's relay on the fake backend (bench_gateway_relay.py) "
                 "instead of serving prompts; the serve flags are then gateway flags")
    relay.add_argument("--relay", action="store_true")
    relay.add_argument("--relay-streams", type=int, default=1000)
    relay.add_argument("--relay-tokens", type=int, default=200, help="tokens per stream")
    relay.add_argument("--relay-step-ms", type=float, default=20.0,
                       help="the fake engine's step (one token per stream per step)")
    relay.add_argument("--relay-rounds", type=int, default=3,
                       help="bursts per server; a run reports their medians")
    a = ap.parse_args(argv)
    for name in ("repeats", "concurrency", "num_prompts", "output_len", "relay_streams",
                 "relay_tokens", "relay_rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        for name in ("serve_args", "base_args", "head_args"):
            setattr(a, name, tuple(shlex.split(getattr(a, name))))
    except ValueError as e:
        ap.error(f"cannot split the serve flags: {e}")
    if "--port" in a.serve_args + a.base_args + a.head_args:
        ap.error("--port is chosen by the script (a free port per server)")
    if a.relay_step_ms <= 0:
        ap.error("--relay-step-ms must be positive")
    return a


def bench_config(a: argparse.Namespace) -> BenchConfig:
    return BenchConfig(num_prompts=a.num_prompts, concurrency=a.concurrency,
                       output_len=a.output_len, seed=a.seed, num_warmup=a.num_warmup,
                       max_prompt_tokens=a.max_prompt_tokens, show_progress=False)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has native bf16: say which path `--dtype auto` served a figure with."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cfg = bench_config(a)
    base_commit, head_commit = resolve(a.base), resolve(a.head)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    result_json = a.result_json or RESULTS_DIR / f"commits-{'relay-' if a.relay else ''}{stamp}.json"
    parent = Path(tempfile.mkdtemp(prefix="zeroserve-bench-commits-"))
    log_dir = parent / "logs"
    trees: dict[str, Path] = {}
    runs: list[Run] = []
    teardown = Teardown()
    teardown.keep_trees = a.keep_worktrees
    teardown.install()
    try:
        for commit in {base_commit, head_commit} - {""}:
            trees[commit] = add_worktree(commit, parent)
            teardown.trees.append(trees[commit])
        sides = (
            Side("base", a.base, a.serve_args + a.base_args, base_commit, trees.get(base_commit)),
            Side("head", a.head, a.serve_args + a.head_args, head_commit, trees.get(head_commit)),
        )
        for side in sides:
            tree = side.tree or REPO_ROOT
            check_importable(launcher_for(tree), tree)
            print(f"{side.name}: {side.rev} -> {launcher_for(tree).module} in {tree}", flush=True)
        samples = None if a.relay else load_chat_samples(
            a.num_prompts, a.seed, max_prompt_tokens=a.max_prompt_tokens)
        for repeat in range(a.repeats):
            for side in order(repeat, sides):
                runs.append(relay_and_measure(side, repeat, a, log_dir) if a.relay else
                            serve_and_measure(side, repeat, cfg, samples, log_dir,
                                              a.startup_timeout_s, teardown))
    finally:
        teardown.run()
    summary = summarize(runs, RELAY_METRICS if a.relay else METRICS)
    text = (relay_table if a.relay else table)(runs, summary, sides)
    result = {
        "command": "python benchmarks/bench_commits.py " + shlex.join(
            sys.argv[1:] if argv is None else argv),
        "started": stamp, "mode": "relay" if a.relay else "serve",
        "cpu_native_bf16": cpu_has_native_bf16(),
        "sides": [{"name": s.name, "rev": s.rev, "commit": s.commit,
                   "serve_args": list(s.serve_args)} for s in sides],
        "summary": summary,
        "runs": [{"side": r.side, "repeat": r.repeat, "cpu_s": r.cpu_s,
                  "cpu_ms_per_token": r.cpu_ms_per_token, "summary": r.summary} for r in runs],
        "table": text,
    }
    result_json.parent.mkdir(parents=True, exist_ok=True)
    result_json.write_text(json.dumps(result, indent=1))
    print("\n" + text)
    if not a.relay:
        print("\n(--dtype auto, as of this commit: fp32 activations, int8 in the layers' "
              "projections for every row (ce216da), a bf16 KV cache; before ce216da prompt "
              "rows took " + ("bf16 GEMMs (7152d79), and before 7152d79 bf16 throughout)"
                               if cpu_has_native_bf16() else "fp32 GEMMs)"))
    print(f"wrote {result_json}; server logs in {log_dir}")
    if a.relay:
        return 0 if not any(r.summary["errors"] for r in runs) else 1
    return 0 if all(r.summary["completed"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
