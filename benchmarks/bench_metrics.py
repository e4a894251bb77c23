"""What metrics cost: the gateway relay benchmark with Prometheus metrics on and off
(`--disable-metrics`), run alternately and repeated, so both sides see the same machine.

The gateway does all of the metrics work (a counter and a histogram per chunk of output, a
few per request), so the figure that matters is the gateway's CPU time per delivered token,
which a shared machine disturbs far less than tokens/s; both are reported, as medians with
their min-max spread, and the ratios on/off. Because a 1% effect is far inside a shared
machine's run-to-run noise, the script also times the metrics calls themselves, replayed
in-process for a request of the same shape (admission, first token, one chunk per token,
finish), and states them as a share of the gateway's measured CPU per token.

    python benchmarks/bench_metrics.py --repeats 5 --streams 500 --tokens 100 --step-ms 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"metrics on": [], "metrics off": ["--gateway-arg=--disable-metrics"]}


def run_once(args: argparse.Namespace, extra: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "bench_gateway_relay.py"),
             "--streams", str(args.streams), "--tokens", str(args.tokens),
             "--step-ms", str(args.step_ms), "--worker", args.worker,
             "--port", str(args.port), "--result-json", out.name, *extra],
            check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def metrics_us_per_token(num_tokens: int, batch: int = 16, repeats: int = 100) -> float:
    """The request path's metrics calls, per token, in microseconds: `batch` requests of
    `num_tokens` one-token chunks whose chunks arrive together (one batch of updates per
    step; the relay benchmark's batches are larger, so this is an upper bound), minus the
    same loop with no calls."""
    sys.path.insert(0, str(ROOT))
    from zeroserve.gateway.observability.metrics import Metrics

    metrics = Metrics("bench").requests

    def run(with_metrics: bool) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            for _ in range(batch):
                if with_metrics:
                    metrics.on_admitted(1)
                    metrics.on_first_token(0.05, 0.001, 0.04)
            for _ in range(num_tokens - 1):
                for _ in range(batch):
                    if with_metrics:
                        metrics.record_gap(0.02)
                if with_metrics:
                    metrics.on_tokens(batch)
            for _ in range(batch):
                if with_metrics:
                    metrics.on_finished("length", num_tokens, 2.0, 0.04, 1.9)
        return (time.perf_counter() - start) / (repeats * batch * num_tokens)

    best = min(run(True) for _ in range(5)) - min(run(False) for _ in range(5))
    return max(0.0, best) * 1e6


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--streams", type=int, default=500)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--worker", choices=["stamped", "fake"], default="stamped")
    ap.add_argument("--port", type=int, default=18777)
    args = ap.parse_args()

    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for i in range(args.repeats):
        # Alternate the order, so neither side always runs on a warmer (or busier) machine.
        order = list(VARIANTS) if i % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            r = run_once(args, VARIANTS[name])
            if r["errors"] or r["completed_streams"] != args.streams:
                raise SystemExit(f"{name}: {r['errors']} errors, "
                                 f"{r['completed_streams']}/{args.streams} streams")
            results[name].append(r)
            print(f"  run {i + 1} {name}: {r['tokens_per_s']} tokens/s, "
                  f"{r.get('gateway_cpu_us_per_token')} us gateway CPU/token", flush=True)

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    print(f"\n{args.streams} streams x {args.tokens} tokens, {args.worker} worker at "
          f"{args.step_ms} ms steps, {args.repeats} runs each (median, min-max):\n")
    print("| | tokens/s | gateway CPU us/token |")
    print("|---|---|---|")
    for name in VARIANTS:
        tps = [r["tokens_per_s"] for r in results[name]]
        cpu = [r["gateway_cpu_us_per_token"] for r in results[name]]
        print(f"| {name} | {summary(tps)} | {summary(cpu)} |")
    on, off = "metrics on", "metrics off"
    print(f"\nthroughput on/off: {median(on, 'tokens_per_s') / median(off, 'tokens_per_s'):.3f}"
          f"; gateway CPU per token on/off: "
          f"{median(on, 'gateway_cpu_us_per_token') / median(off, 'gateway_cpu_us_per_token'):.3f}")
    cost = metrics_us_per_token(args.tokens)
    gateway_cpu = median(off, "gateway_cpu_us_per_token")
    print(f"metrics calls: {cost:.3f} us per token (best of 5, in-process) = "
          f"{100 * cost / gateway_cpu:.2f}% of the gateway's {gateway_cpu:.1f} us CPU per token")


if __name__ == "__main__":
    main()
