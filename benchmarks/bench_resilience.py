"""Resilience under load, as a time series: throughput and p99 latency through a kill -9 of
a worker and through a rolling restart, beside the steady state.

Starts `zeroserve serve --workers 2` on loopback and runs `--concurrency` closed-loop
streaming completions of `--output-len` tokens (`ignore_eos`) for the whole run. The run has
three phases of `--phase-s` seconds each:

1. steady: the load alone;
2. kill -9: at its start worker-0 is SIGKILLed (its streams move to worker-1; the
   supervisor starts worker-0 again);
3. rolling restart: at its start `zeroserve workers restart --all --deadline D` runs.

Per `--bucket-s` bucket it reports the chunks (about one token each) that reached the
clients per second, the p99 gap between a stream's chunks that ended in the bucket (a
failover shows as a pause here), and the requests that ended in the bucket and failed.
Every request is checked: a [DONE], no error event, usage.completion_tokens == output-len.

    python benchmarks/bench_resilience.py --quick            # fake backend, 20 ms steps
    python benchmarks/bench_resilience.py                    # the default model on the CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))
from benchmarks.bench_serving import RequestResult, send_request  # noqa: E402
from zeroserve.cli.harness import start_server, zeroserve_argv  # noqa: E402

PHASES = ("steady", "kill -9 worker-0", "rolling restart")


def serve_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The `zeroserve serve` flags of this run but --port."""
    flags = ["--device", "cpu", "--workers", "2", *args.server_args]
    if args.quick:
        flags += ["--backend", "fake", "--fake-forward-ms", "20", "--num-kv-blocks", "4096"]
    return tuple(flags)


def health(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return json.loads(r.read())
    except OSError as e:
        return json.loads(e.read()) if hasattr(e, "read") else {}


async def client(session: aiohttp.ClientSession, url: str, body: dict, t0: float,
                 stop_at: float, results: list[RequestResult]) -> None:
    while time.perf_counter() < stop_at:
        result = RequestResult(len(results), body["max_tokens"])
        results.append(result)
        await send_request(session, url, body, result, t0)


def chunk_times(result: RequestResult) -> list[float]:
    """Arrival times of a request's text chunks, relative to the run's start."""
    if result.ttft_s is None:
        return []
    times = [result.start_s + result.ttft_s]
    for gap in result.chunk_gaps_s:
        times.append(times[-1] + gap)
    return times


def is_intact(result: RequestResult, output_len: int) -> bool:
    return result.is_success and result.num_output_tokens == output_len


def buckets(results: list[RequestResult], output_len: int, bucket_s: float,
            end_s: float) -> list[dict]:
    num = int(end_s // bucket_s) + 1
    rows = [{"t": i * bucket_s, "chunks": 0, "gaps": [], "failed": 0} for i in range(num)]
    for result in results:
        times = chunk_times(result)
        for i, t in enumerate(times):
            k = min(int(t // bucket_s), num - 1)
            rows[k]["chunks"] += 1
            if i:
                rows[k]["gaps"].append(t - times[i - 1])
        if result.e2e_s is not None and not is_intact(result, output_len):
            rows[min(int((result.start_s + result.e2e_s) // bucket_s), num - 1)]["failed"] += 1
    for row in rows:
        gaps = sorted(row.pop("gaps"))
        row["chunks_per_s"] = row["chunks"] / bucket_s
        row["p99_gap_ms"] = 1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps \
            else None
        row["max_gap_ms"] = 1000 * gaps[-1] if gaps else None
    return rows[:-1]  # the last bucket is cut short by the end of the run


def run_events(args: argparse.Namespace, url: str, t0: float, events: list) -> None:
    """Phase 2: kill -9 worker-0; phase 3: a rolling restart (on a thread of its own)."""
    time.sleep(max(0.0, t0 + args.phase_s - time.perf_counter()))
    victim = next(w for w in health(url)["workers"] if w["worker_id"] == "worker-0")
    os.kill(victim["pid"], signal.SIGKILL)
    events.append((time.perf_counter() - t0, "kill -9 worker-0"))
    time.sleep(max(0.0, t0 + 2 * args.phase_s - time.perf_counter()))
    events.append((time.perf_counter() - t0, "rolling restart begins"))
    done = subprocess.run(zeroserve_argv("workers", "restart", "--all", "--deadline",
                                         str(args.drain_deadline), "--url", url),
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    events.append((time.perf_counter() - t0,
                   f"rolling restart ends (exit {done.returncode}): "
                   + " / ".join(done.stdout.strip().splitlines())))


async def main_async(args: argparse.Namespace, url: str) -> tuple[list, list, float]:
    body = {"prompt": "Tell me a long story about the sea.", "max_tokens": args.output_len,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    results: list[RequestResult] = []
    events: list = []
    t0 = time.perf_counter()
    stop_at = t0 + 3 * args.phase_s
    thread = threading.Thread(target=run_events, args=(args, url, t0, events), daemon=True)
    thread.start()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session, url + "/v1/completions", body, t0, stop_at,
                                      results) for _ in range(args.concurrency)))
    thread.join(timeout=600)
    return results, events, time.perf_counter() - t0


def report(args: argparse.Namespace, results: list, events: list, wall_s: float) -> str:
    rows = buckets(results, args.output_len, args.bucket_s, wall_s)
    lines = ["| t (s) | chunks/s | p99 gap (ms) | max gap (ms) | failed | phase |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        phase = PHASES[min(int(row["t"] // args.phase_s), 2)]
        p99, top = ("-" if row[k] is None else f"{row[k]:.0f}"
                    for k in ("p99_gap_ms", "max_gap_ms"))
        lines.append(f"| {row['t']:.0f} | {row['chunks_per_s']:.0f} | {p99} | {top} | "
                     f"{row['failed']} | {phase} |")
    num_intact = sum(is_intact(r, args.output_len) for r in results if r.e2e_s is not None)
    num_done = sum(r.e2e_s is not None for r in results)
    summary = [f"requests ended: {num_done}, intact: {num_intact}, "
               f"failed: {num_done - num_intact}"]
    for phase_index, name in enumerate(PHASES):
        in_phase = [r for r in rows if min(int(r["t"] // args.phase_s), 2) == phase_index]
        rate = sum(r["chunks"] for r in in_phase) / max(1e-9, len(in_phase) * args.bucket_s)
        worst = max((r["p99_gap_ms"] or 0) for r in in_phase)
        longest = max((r["max_gap_ms"] or 0) for r in in_phase)
        summary.append(f"{name}: {rate:.0f} chunks/s, worst bucket p99 gap {worst:.0f} ms, "
                       f"longest gap {longest:.0f} ms")
    summary += [f"event at {t:.1f}s: {what}" for t, what in events]
    return "\n".join(lines + [""] + summary)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fake backend, 20 ms steps")
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--phase-s", type=float, default=20.0)
    p.add_argument("--bucket-s", type=float, default=1.0)
    p.add_argument("--drain-deadline", type=float, default=5.0)
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="more flags for `zeroserve serve` (last on the line)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    server = start_server(args=serve_args(args), num_workers=2, port=args.port,
                          log_path=REPO / ".bench" / "resilience-server.log", timeout_s=600)
    try:
        results, events, wall_s = asyncio.run(main_async(args, url))
        print(report(args, results, events, wall_s))
    finally:
        server.stop(timeout_s=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
