"""Fairness benchmark: priority classes and fair queuing across API keys (issue 39).

Starts `zeroserve serve --backend fake` (one worker, no model: the gateway's queue and the
worker's scheduler are what is measured) with four API keys and a limits file:

    key-a, key-b: standard     key-c: critical     key-s: sheddable

and runs, each phase on a fresh server for `--seconds`:

1. `b-alone`: key B sends one streamed request a second (open loop), nothing else runs.
2. `a+b fair` / `a+b fcfs`: key A keeps `--a-in-flight` requests in flight (closed loop)
   while B sends one a second; the gateway's queue is `--scheduling-policy fair` or `fcfs`.
3. `c-alone`, then `flood+c fair` / `flood+c fcfs`: the sheddable key floods
   (`--flood-in-flight` in flight, retrying a refusal after its Retry-After, or
   `--flood-backoff` seconds) while
   the critical key sends one request a second.

It reports, per phase and key, requests done, refused (429) and failed, and TTFT p50/p99 (the
first streamed token); for B and C the ratio of p99 to their p99 alone, and that ratio's
floor; per phase, the CPU seconds the server's processes (gateway, worker, supervisor) spent
in it.

The floor: alone, a request finds the worker idle and starts at once; beside a full batch it
arrives during a step and waits for that step to end (a forward on the device cannot take a
new sequence), up to one `--forward-ms`, then starts in the very next step (in the slot of
the busy key's newest request). So p99 under load is at least about alone p99 + one forward,
and `floor` = (alone p99 + forward) / alone p99 whatever the queueing does; what a phase
measures above it is the gateway's and the machine's (event-loop lag, CPU contention). The measured keys (B,
C) send from a process of their own (`--one-client`: from the busy keys' process). B and C send
`--rate` requests a second (1 by default, as issue 39 states it), so a phase of `--seconds` N
gives N x rate samples and p99 is the slowest of them below 100: a longer phase or a higher
rate gives a p99 less at the mercy of one sample. Beside a busy key, the measured key starts
`--settle` seconds (1 by default) after it, so that it measures the busy key's steady state:
at the busy key's start its 64 (or 256) requests arrive in the same millisecond and take the
gateway's loop some 20-30 ms to admit, and the measured key's first request, sent in that
millisecond, waited for them (with 80 samples, p99 is the slowest: that one). The server's CPU
seconds cover the settle too. The worker holds
`--max-num-seqs` sequences and `--max-waiting-per-worker` more; the rest wait in the gateway.

    python benchmarks/bench_fairness.py --seconds 20
    python benchmarks/bench_fairness.py --seconds 10 --json /tmp/fair.json
    python benchmarks/bench_fairness.py --seconds 60 --phases "c-alone,flood+c fair"
    python benchmarks/bench_fairness.py --seconds 40 --rate 4 --phases "b-alone,a+b fair"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from zeroserve.cli.harness import start_server  # noqa: E402

KEYS = {"a": "key-a", "b": "key-b", "c": "key-c", "s": "key-s"}
LIMITS = {"key-a": {}, "key-b": {}, "key-c": {"priority_class": "critical"},
          "key-s": {"priority_class": "sheddable"}}


@dataclass
class KeyResult:
    ttfts: list[float] = field(default_factory=list)
    num_refused: int = 0
    num_failed: int = 0
    retry_after_s: float = 1.0  # the last refusal's Retry-After

    def quantile(self, q: float) -> float | None:
        if not self.ttfts:
            return None
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_request(session: aiohttp.ClientSession, url: str, key: str, max_tokens: int,
                      result: KeyResult) -> bool:
    """One streamed completion; its TTFT into `result`. False when refused (429)."""
    body = {"model": "fake", "prompt": "Tell me a story about queues.", "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True}
    start = time.monotonic()
    try:
        async with session.post(url + "/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status == 429:
                result.num_refused += 1
                await r.read()
                result.retry_after_s = float(r.headers.get("Retry-After", "1"))
                return False
            if r.status != 200:
                result.num_failed += 1
                await r.read()
                return True
            first = None
            async for line in r.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.monotonic() - start
            if first is not None:
                result.ttfts.append(first)
    except (TimeoutError, aiohttp.ClientError):
        result.num_failed += 1
    return True


async def closed_loop(session, url, key, num_in_flight, max_tokens, until, result,
                      backoff_s: float = 0.0) -> None:
    async def loop() -> None:
        while time.monotonic() < until:
            if not await one_request(session, url, key, max_tokens, result):
                await asyncio.sleep(result.retry_after_s if backoff_s is None else backoff_s)

    await asyncio.gather(*(loop() for _ in range(num_in_flight)))


async def open_loop(session, url, key, rate, max_tokens, until, result,
                    start_at: float | None = None) -> None:
    """`rate` requests a second from `start_at` (time.monotonic(); None: now) until `until`."""
    tasks = []
    next_at = time.monotonic() if start_at is None else start_at
    while next_at < until:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        tasks.append(asyncio.create_task(one_request(session, url, key, max_tokens, result)))
        next_at += 1.0 / rate
    await asyncio.gather(*tasks)


def new_session(args) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=args.seconds + 120)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))


async def run_flows(url: str, args, flows: dict[str, tuple], until: float,
                    warm_up: bool = False, measured_from: float | None = None
                    ) -> dict[str, KeyResult]:
    """flows: key name -> ("closed", in_flight, backoff) or ("open", rate), until `until`
    (time.monotonic(), alike in every process); the open (measured) ones from
    `measured_from` (None: at once)."""
    results = {name: KeyResult() for name in flows}
    async with new_session(args) as session:
        if warm_up:  # the worker's first steps
            await one_request(session, url, KEYS["b"], 4, KeyResult())
        jobs = []
        for name, spec in flows.items():
            if spec[0] == "closed":
                jobs.append(closed_loop(session, url, KEYS[name], spec[1], args.a_max_tokens,
                                        until, results[name], spec[2]))
            else:
                jobs.append(open_loop(session, url, KEYS[name], spec[1], args.b_max_tokens,
                                      until, results[name], measured_from))
        await asyncio.gather(*jobs)
    return results


def run_flows_here(url: str, args, flows: dict[str, tuple], until: float,
                   measured_from: float | None = None) -> dict[str, dict]:
    """run_flows in a process of its own (a ProcessPoolExecutor's); the results as plain
    dicts (this module is __mp_main__ there, a name the parent cannot unpickle)."""
    results = asyncio.run(run_flows(url, args, flows, until, measured_from=measured_from))
    return {name: vars(result) for name, result in results.items()}


async def run_phase(url: str, args, flows: dict[str, tuple],
                    pool: ProcessPoolExecutor | None) -> dict[str, KeyResult]:
    """The busy keys' loops here; the measured (open-loop) keys' in `pool`'s process when
    there is one, so their TTFT is not the time this process's event loop took to get to
    them among the flood's hundreds of requests and responses (a real interactive client
    does not share a process with a batch job; the server's load is the same either way).

    Beside busy keys the measured ones start `--settle` seconds after them and then run
    `--seconds`: their samples are of the busy keys' steady state (A with its requests in
    flight), not of their start, whose first requests all arrive in the same millisecond."""
    async with new_session(args) as session:  # warm-up: the worker's first steps
        await one_request(session, url, KEYS["b"], 4, KeyResult())
    measured = {name: spec for name, spec in flows.items() if spec[0] == "open"}
    busy = {name: spec for name, spec in flows.items() if spec[0] != "open"}
    measured_from = time.monotonic() + (args.settle if busy and measured else 0.0)
    until = measured_from + args.seconds
    if pool is None:
        return await run_flows(url, args, flows, until, measured_from=measured_from)
    remote = asyncio.get_running_loop().run_in_executor(pool, run_flows_here, url, args,
                                                        measured, until, measured_from)
    results = await run_flows(url, args, busy, until)
    return results | {name: KeyResult(**fields) for name, fields in (await remote).items()}


def serve_args(policy: str, args, limits_path: Path) -> list[str]:
    return ["--backend", "fake", "--fake-forward-ms", str(args.forward_ms),
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-waiting-per-worker", str(args.max_waiting_per_worker),
            "--max-queued-requests", str(args.max_queued), "--scheduling-policy", policy,
            "--served-model-name", "fake", "--rate-limits", str(limits_path),
            "--api-key", ",".join(KEYS.values()), "--log-level", "warning"]


def run(policy: str, args, limits_path: Path, log_dir: Path,
        flows: dict) -> tuple[dict, float]:
    """The phase's results by key, and the server's CPU seconds during it."""
    server = start_server(args=tuple(serve_args(policy, args, limits_path)), wait=False,
                          log_path=log_dir / f"serve-{policy}-{time.time():.0f}.log")
    pool = None if args.one_client else ProcessPoolExecutor(1, mp_context=get_context("spawn"))
    try:
        if pool is not None:
            pool.submit(time.monotonic).result()  # started before the phase
        wait_served(server.url)
        cpu_before = tree_cpu_s(server.process.pid)
        results = asyncio.run(run_phase(server.url, args, flows, pool))
        return results, tree_cpu_s(server.process.pid) - cpu_before
    finally:
        server.stop(timeout_s=10)
        if pool is not None:
            pool.shutdown()


def tree_cpu_s(root_pid: int) -> float:
    """utime + stime of `root_pid` and its live descendants, in seconds."""
    parent_of: dict[int, int] = {}
    cpu_of: dict[int, float] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:  # fields after the command's name
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            parent_of[int(entry)] = int(fields[1])
            cpu_of[int(entry)] = (int(fields[11]) + int(fields[12])) / ticks
    total, todo = 0.0, [root_pid]
    while todo:
        pid = todo.pop()
        total += cpu_of.get(pid, 0.0)
        todo.extend(child for child, parent in parent_of.items() if parent == pid)
    return total


def wait_served(url: str, timeout_s: float = 120.0) -> None:
    """Until a key's request is answered (with API keys set, /health tells a caller without
    one nothing about the workers)."""
    request = urllib.request.Request(url + "/v1/models",
                                     headers={"Authorization": f"Bearer {KEYS['b']}"})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(request, timeout=2) as r:
                if r.status == 200 and json.loads(r.read())["data"]:
                    body = json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 1})
                    probe = urllib.request.Request(
                        url + "/v1/completions", data=body.encode(), method="POST",
                        headers={"Authorization": f"Bearer {KEYS['b']}",
                                 "Content-Type": "application/json"})
                    with urllib.request.urlopen(probe, timeout=10) as answer:
                        if answer.status == 200:
                            return
        except (OSError, ValueError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} served nothing within {timeout_s:g}s")


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="each phase's length (of its measured keys' requests)")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="seconds the busy keys run before the measured keys start (0: "
                             "all at once, as before 2026-11-29 evening, when B's first "
                             "request met A's first 64 in the gateway)")
    parser.add_argument("--a-in-flight", type=int, default=64)
    parser.add_argument("--flood-in-flight", type=int, default=256)
    parser.add_argument("--flood-backoff", type=float, default=None,
                        help="seconds a refused flood request waits before it retries "
                             "[default: the refusal's Retry-After]")
    parser.add_argument("--a-max-tokens", type=int, default=64,
                        help="output tokens of the busy and flooding keys' requests")
    parser.add_argument("--b-max-tokens", type=int, default=16,
                        help="output tokens of the interactive keys' requests")
    parser.add_argument("--rate", type=float, default=1.0,
                        help="requests a second of each measured key (B, C)")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-waiting-per-worker", type=int, default=2)
    parser.add_argument("--max-queued", type=int, default=128)
    parser.add_argument("--forward-ms", type=float, default=10.0,
                        help="the fake worker's milliseconds per forward")
    parser.add_argument("--skip-flood", action="store_true", help="only the A/B phases")
    parser.add_argument("--phases", default=None,
                        help="only these phases, by name, comma-separated (as printed); a "
                             "ratio needs its key's `alone` phase among them")
    parser.add_argument("--one-client", action="store_true",
                        help="the measured keys' requests from this process too (as before "
                             "2026-11-29), where the busy keys' traffic delays them")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()

    log_dir = Path(tempfile.mkdtemp(prefix="bench-fairness-"))
    limits_path = log_dir / "limits.json"
    limits_path.write_text(json.dumps(LIMITS))
    phases: list[tuple[str, str, dict]] = [
        ("b-alone", "fair", {"b": ("open", args.rate)}),
        ("a+b fair", "fair", {"a": ("closed", args.a_in_flight, None), "b": ("open", args.rate)}),
        ("a+b fcfs", "fcfs", {"a": ("closed", args.a_in_flight, None), "b": ("open", args.rate)}),
    ]
    if not args.skip_flood:
        flood = ("closed", args.flood_in_flight, args.flood_backoff)
        phases += [("c-alone", "fair", {"c": ("open", args.rate)}),
                   ("flood+c fair", "fair", {"s": flood, "c": ("open", args.rate)}),
                   ("flood+c fcfs", "fcfs", {"s": flood, "c": ("open", args.rate)})]
    report = {}
    alone: dict[str, float | None] = {}
    if args.phases is not None:
        chosen = args.phases.split(",")
        unknown = set(chosen) - {name for name, _, _ in phases}
        if unknown:
            parser.error(f"unknown phases: {', '.join(sorted(unknown))}")
        phases = [phase for phase in phases if phase[0] in chosen]
    print(f"{'phase':<14} {'key':<4} {'done':>6} {'429':>6} {'failed':>6} "
          f"{'ttft p50 ms':>12} {'ttft p99 ms':>12} {'p99/alone':>10} {'floor':>6} "
          f"{'server cpu s':>13}")
    for phase, policy, flows in phases:
        results, cpu_s = run(policy, args, limits_path, log_dir, flows)
        for name, result in results.items():
            p99 = result.quantile(0.99)
            if phase.endswith("alone"):
                alone[name] = p99
            ratio = floor = None
            if p99 is not None and alone.get(name) and not phase.endswith("alone"):
                ratio = p99 / alone[name]
                floor = (alone[name] + args.forward_ms / 1000) / alone[name]
            print(f"{phase:<14} {name:<4} {len(result.ttfts):>6} {result.num_refused:>6} "
                  f"{result.num_failed:>6} {fmt(result.quantile(0.5)):>12} {fmt(p99):>12} "
                  f"{'-' if ratio is None else f'{ratio:.2f}x':>10} "
                  f"{'-' if floor is None else f'{floor:.2f}x':>6} {cpu_s:>13.1f}")
            report.setdefault(phase, {})[name] = {
                "num_done": len(result.ttfts), "num_refused": result.num_refused,
                "num_failed": result.num_failed, "ttft_p50_s": result.quantile(0.5),
                "ttft_p99_s": p99, "p99_over_alone": ratio, "floor_over_alone": floor,
                "server_cpu_s": cpu_s}
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "phases": report},
                                              indent=2))
    print(f"server logs: {log_dir}")


if __name__ == "__main__":
    main()
