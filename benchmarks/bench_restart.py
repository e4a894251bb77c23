"""Worker restart time: from SIGKILL (and from the new process's start) to ready in /health.

Starts `zeroserve serve` on loopback with a weight cache of its own (a fresh temporary
`ZEROSERVE_CACHE_DIR`), then, per scenario, SIGKILLs worker-0 (pid from /health) and polls
/health every 20 ms until worker-0 is listed ready with a new pid. It reports per restart:

- `kill_to_ready_s`: SIGKILL sent -> ready in /health (includes the supervisor noticing the
  exit and its restart backoff, 0.5 s after a stable run);
- `start_to_ready_s`: the new process's start (its /proc start time, 10 ms ticks) -> ready;
- the worker's own `startup_phases_s` from /health (what its HELLO said).

Scenarios:
- `quiet`: `serve --workers 1`, nothing else running.
- `busy`: `serve --workers 2`, `--busy-clients` closed-loop completions running all the time;
  with worker-0 dead they all land on worker-1, which is busy on the same cores while worker-0
  starts again.

Each scenario first restarts with an empty weight cache (`cold`, `--cold-repeats`), then
with the cache in place (`warm`, `--repeats`), and prints medians. Between kills it waits
`--settle-s` (31 s: the supervisor's backoff resets after 30 s of stable running, so every
restart gets the same 0.5 s backoff).

    python benchmarks/bench_restart.py                       # both scenarios, default model
    python benchmarks/bench_restart.py --scenario quiet --repeats 3 --settle-s 31
    python benchmarks/bench_restart.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from zeroserve.cli.harness import ServerProcess, free_port, start_server

WORKER = "worker-0"


def boot_clock() -> float:
    """Seconds since boot, the clock /proc/<pid>/stat start times are counted on."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def process_start(pid: int) -> float | None:
    """The process's start on boot_clock() (10 ms resolution), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime in ticks


def start_serve(args: argparse.Namespace, num_workers: int, cache_dir: Path) -> ServerProcess:
    """`zeroserve serve` with a weight cache of its own; not waited for."""
    port = free_port()
    return start_server(args=("--workers", str(num_workers), "--model", args.model,
                              "--device", "cpu", *args.serve_args), port=port, wait=False,
                        env={"ZEROSERVE_CACHE_DIR": str(cache_dir)},
                        log_path=Path(tempfile.gettempdir()) / f"bench_restart_{port}.log")


def workers_by_id(server: ServerProcess) -> dict[str, dict]:
    return {w["worker_id"]: w for w in server.workers()}


def wait_worker_ready(server: ServerProcess, worker_id: str, not_pid: int | None,
                      timeout_s: float) -> dict:
    """Polls /health every 20 ms until `worker_id` is ready with a pid other than
    `not_pid`; its /health entry."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        w = workers_by_id(server).get(worker_id)
        if w is not None and w["status"] == "ready" and w["pid"] != not_pid:
            return w
        if server.process.poll() is not None:
            raise RuntimeError(f"serve exited with {server.process.returncode}; "
                               f"see {server.log_path}")
        time.sleep(0.02)
    raise TimeoutError(f"{worker_id} not ready within {timeout_s} s; see {server.log_path}")


class BusyLoad:
    """Closed-loop completions (`ignore_eos`, fixed length) until stopped."""

    def __init__(self, url: str, num_clients: int, max_tokens: int):
        self.url = url + "/v1/completions"
        self.body = json.dumps({"prompt": "Tell me a long story about a lighthouse keeper.",
                                "max_tokens": max_tokens, "ignore_eos": True,
                                "temperature": 0.0}).encode()
        self.stopped = threading.Event()
        self.num_done = 0
        self.num_failed = 0
        self.threads = [threading.Thread(target=self._loop, daemon=True)
                        for _ in range(num_clients)]
        for t in self.threads:
            t.start()

    def _loop(self) -> None:
        while not self.stopped.is_set():
            request = urllib.request.Request(self.url, self.body,
                                             {"content-type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=300) as response:
                    response.read()
                self.num_done += 1
            except (OSError, ValueError):
                self.num_failed += 1
                time.sleep(0.2)

    def stop(self) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(timeout=310)


def restart_once(server: ServerProcess, timeout_s: float) -> dict:
    old = workers_by_id(server)[WORKER]
    killed = time.monotonic()
    os.kill(old["pid"], signal.SIGKILL)
    ready = wait_worker_ready(server, WORKER, not_pid=old["pid"], timeout_s=timeout_s)
    ready_at, ready_boot = time.monotonic(), boot_clock()
    start = process_start(ready["pid"])
    return {
        "kill_to_ready_s": round(ready_at - killed, 3),
        "start_to_ready_s": None if start is None else round(ready_boot - start, 3),
        "phases_s": ready.get("startup_phases_s", {}),
    }


def run_scenario(args: argparse.Namespace, name: str) -> dict:
    cache_dir = Path(tempfile.mkdtemp(prefix="zeroserve-bench-cache-"))
    started = time.monotonic()
    server = start_serve(args, 2 if name == "busy" else 1, cache_dir)
    load = None
    results: dict = {"scenario": name, "cold": [], "warm": []}
    try:
        first = wait_worker_ready(server, WORKER, None, args.timeout_s)
        start = process_start(first["pid"])
        results["first_start"] = {
            "serve_to_ready_s": round(time.monotonic() - started, 3),
            "start_to_ready_s": None if start is None else round(boot_clock() - start, 3),
            "phases_s": first.get("startup_phases_s", {}),
        }
        if name == "busy":
            wait_worker_ready(server, "worker-1", None, args.timeout_s)
            load = BusyLoad(server.url, args.busy_clients, args.busy_tokens)
        for kind, repeats in (("cold", args.cold_repeats), ("warm", args.repeats)):
            for i in range(repeats):
                time.sleep(args.settle_s)
                if kind == "cold":
                    shutil.rmtree(cache_dir, ignore_errors=True)
                result = restart_once(server, args.timeout_s)
                results[kind].append(result)
                print(f"{name} {kind} {i + 1}/{repeats}: {json.dumps(result)}", flush=True)
        if load is not None:
            load.stop()
            results["busy_requests"] = {"done": load.num_done, "failed": load.num_failed}
            load = None
    finally:
        if load is not None:
            load.stop()
        server.stop(timeout_s=30)
        shutil.rmtree(cache_dir, ignore_errors=True)
    for kind in ("cold", "warm"):
        results[f"{kind}_median"] = summarize(results[kind])
    return results


def summarize(runs: list[dict]) -> dict:
    if not runs:
        return {}
    out = {key: round(statistics.median(r[key] for r in runs if r[key] is not None), 3)
           for key in ("kill_to_ready_s", "start_to_ready_s")}
    names = {name for r in runs for name in r["phases_s"]}
    out["phases_s"] = {name: round(statistics.median(r["phases_s"].get(name, 0.0)
                                                     for r in runs), 3)
                       for name in sorted(names)}
    out["num_runs"] = len(runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=["quiet", "busy", "both"], default="both")
    parser.add_argument("--model", default="default")
    parser.add_argument("--repeats", type=int, default=5, help="warm-cache restarts")
    parser.add_argument("--cold-repeats", type=int, default=1, help="empty-cache restarts")
    parser.add_argument("--settle-s", type=float, default=31.0)
    parser.add_argument("--busy-clients", type=int, default=8)
    parser.add_argument("--busy-tokens", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=180.0)
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    parser.add_argument("serve_args", nargs="*", help="more `zeroserve serve` flags (after --)")
    args = parser.parse_args()
    scenarios = ["quiet", "busy"] if args.scenario == "both" else [args.scenario]
    report = [run_scenario(args, name) for name in scenarios]
    for r in report:
        print(f"\n== {r['scenario']}: first start {json.dumps(r['first_start'])}")
        for kind in ("cold", "warm"):
            print(f"   {kind} median: {json.dumps(r[f'{kind}_median'])}")
        if "busy_requests" in r:
            print(f"   busy load: {r['busy_requests']}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
