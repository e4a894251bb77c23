"""The box's KV tier against replay (issue 37), side by side: `zeroserve serve --workers 2`
once with the tier off and once with `--kv-offloading-size`, the same requests on each.

1. Failover: a streamed completion with a `--context`-token prompt (random token ids, new
   each run, so nothing holds them before); after `--chunks-before-kill` tokens its worker is
   SIGKILLed. Reported: the time from the kill to the stream's next token (replay: the other
   worker prefills the whole context again; tier: it loads the blocks the dead worker wrote),
   beside the median gap between tokens before the kill.
2. A prefix another worker computed: a `--prefix`-token prompt is completed once (one token),
   then that worker is SIGKILLed and restarted, so that no worker's own pool holds the prefix
   (the restart case, and the cross-worker case: both see only the tier); the same prefix
   with a new tail is then sent again. Reported: its TTFT (tier: loaded; off: a miss).

Tokens are compared too: in tier mode an undisturbed run goes first, and the failed-over
stream must give its tokens (greedy). One JSON line per mode, then a summary.

`--cost`: what the tier costs when nothing is reused, in one process: an engine on the
default model runs `--clients` distinct prompts at once (prefill and decode, every full
block written through), tier off and on alternated `--repeats` times; reported per mode:
the least CPU seconds (the process's, the writer thread's included) and wall seconds per
output token, and their ratio.

    python benchmarks/bench_kv_tier.py                       # default model, ~6k context
    python benchmarks/bench_kv_tier.py --context 1500 --prefix 1000   # quicker
    python benchmarks/bench_kv_tier.py --cost --clients 16            # the cost, no reuse
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))
from zeroserve.cli.harness import start_server  # noqa: E402

TOKEN_RANGE = (1000, 30000)  # ordinary tokens of the default model's vocabulary


def random_prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(num_tokens)]


class Stream:
    """A streamed completion read in a thread; each token's arrival time."""

    def __init__(self, url: str, body: dict) -> None:
        self.times: list[float] = []
        self.text: list[str] = []
        self.error: str | None = None
        self.is_done = False
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=600,
                              json={**body, "stream": True}) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = str(event["error"])
                        continue
                    self.times.append(time.monotonic())
                    self.text.append(event["choices"][0]["text"])
        except Exception as exc:  # reported with the run
            self.error = repr(exc)
        self.is_done = True

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise TimeoutError(what)


def restart_worker(server, worker: dict) -> None:
    os.kill(worker["pid"], signal.SIGKILL)
    server.wait_for(lambda ws: any(w["worker_id"] == worker["worker_id"]
                                   and w["status"] == "ready" and w["pid"] != worker["pid"]
                                   for w in ws), timeout_s=300, what="worker restarted")
    server.wait_ready(2, timeout_s=300)


def failover(server, args, rng: random.Random) -> dict:
    body = {"prompt": random_prompt(rng, args.context), "max_tokens": args.max_tokens,
            "temperature": 0, "ignore_eos": True}
    expected = None
    tier = args.tier_dir
    if tier is not None:  # the undisturbed run, for its tokens
        reference = httpx.post(server.url + "/v1/completions", json=body, timeout=1800).json()
        expected = reference["choices"][0]["text"]
        # Its worker holds the prompt in its pool: restart both and empty the tier, so that
        # the stream below and its failover find it nowhere but in what the stream writes.
        for worker in server.workers():
            restart_worker(server, worker)
        for path in Path(tier).glob("*.kv"):
            path.unlink()
    stream = Stream(server.url, body)
    wait_until(lambda: len(stream.times) >= args.chunks_before_kill or stream.is_done, 1800,
               "first tokens")
    if stream.is_done:
        return {"error": f"the stream ended before the kill: {stream.error}"}
    victim = next(w for w in server.workers() if w.get("num_in_flight"))
    num_before = len(stream.times)
    gaps = [b - a for a, b in zip(stream.times[1:num_before - 1], stream.times[2:num_before],
                                  strict=True)]
    killed_at = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    wait_until(lambda: len(stream.times) > num_before or stream.is_done, 1800, "next token")
    resumed_s = stream.times[num_before] - killed_at if len(stream.times) > num_before else None
    stream.join(900)
    server.wait_ready(2, timeout_s=300)
    return {"kill_to_next_token_s": resumed_s,
            "median_gap_before_s": statistics.median(gaps) if gaps else None,
            "same_tokens": None if expected is None else "".join(stream.text) == expected,
            "error": stream.error}


def shared_prefix(server, args, rng: random.Random) -> dict:
    prefix = random_prompt(rng, args.prefix)
    first = {"prompt": prefix + random_prompt(rng, 8), "max_tokens": 1, "temperature": 0}
    stream = Stream(server.url, first)
    wait_until(lambda: any(w.get("num_in_flight") for w in server.workers()), 60, "routed")
    computing = next(w for w in server.workers() if w.get("num_in_flight"))
    stream.join(900)
    time.sleep(1.0)  # the last blocks' write-through, a step behind
    restart_worker(server, computing)
    second = Stream(server.url, {"prompt": prefix + random_prompt(rng, 8), "max_tokens": 1,
                                 "temperature": 0})
    second.join(900)
    return {"ttft_s": (second.times[0] - second.started) if second.times else None,
            "error": second.error}


def run_mode(args, tier_size: float) -> dict:
    rng = random.Random(args.seed)
    folder = tempfile.mkdtemp(prefix="bench-kv-tier-")
    args.tier_dir = os.path.join(folder, "kv") if tier_size else None
    flags = ["--device", "cpu", "--workers", "2", "--max-model-len",
             str(max(args.context, args.prefix) + args.max_tokens + 64), *args.server_args]
    if tier_size:
        flags += ["--kv-offloading-size", str(tier_size), "--kv-offloading-dir", args.tier_dir]
    server = start_server(Path(folder), args=tuple(flags), num_workers=2, timeout_s=600)
    try:
        result = {"mode": "tier" if tier_size else "replay",
                  "failover": failover(server, args, rng),
                  "shared_prefix": shared_prefix(server, args, rng)}
    finally:
        server.stop(timeout_s=30)
    print(json.dumps(result), flush=True)
    return result


def cost(args) -> int:
    """Tier off and on alternated in one process: CPU and wall seconds per output token."""
    from zeroserve.worker.config import EngineConfig
    from zeroserve.worker.engine import Engine
    from zeroserve.worker.sequence import SamplingParams

    folder = tempfile.mkdtemp(prefix="bench-kv-tier-cost-", dir="/dev/shm")
    engines = {
        "off": Engine(EngineConfig(device="cpu", max_num_seqs=args.clients)),
        "on": Engine(EngineConfig(device="cpu", max_num_seqs=args.clients,
                                  kv_offloading_size=args.tier_size,
                                  kv_offloading_dir=os.path.join(folder, "kv"))),
    }
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    best: dict[str, tuple[float, float]] = {}
    for repeat in range(args.repeats):
        for mode, engine in engines.items():
            prompts = [random_prompt(rng, args.prompt_len) for _ in range(args.clients)]
            cpu0, wall0 = time.process_time(), time.perf_counter()
            outputs = engine.generate(prompts, params)
            if engine.tier is not None:
                engine.tier.wait_written()  # its writes are part of the cost
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            num_tokens = sum(len(o) for o in outputs)
            per_token = (cpu / num_tokens, wall / num_tokens)
            print(json.dumps({"mode": mode, "repeat": repeat, "cpu_s_per_token": per_token[0],
                              "wall_s_per_token": per_token[1]}), flush=True)
            old = best.get(mode)
            best[mode] = per_token if old is None else (min(old[0], per_token[0]),
                                                        min(old[1], per_token[1]))
    shutil.rmtree(folder, ignore_errors=True)
    print(f"tier on / off, {args.clients} clients, nothing reused: CPU per output token "
          f"{best['on'][0] / best['off'][0]:.3f}x, wall {best['on'][1] / best['off'][1]:.3f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=6000)
    parser.add_argument("--prefix", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--chunks-before-kill", type=int, default=10)
    parser.add_argument("--tier-size", type=float, default=2.0, help="GiB")
    parser.add_argument("--seed", type=int, default=37)
    parser.add_argument("--cost", action="store_true", help="measure the tier's cost only")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args(argv)
    if args.cost:
        return cost(args)
    replay = run_mode(args, 0.0)
    tier = run_mode(args, args.tier_size)
    r, t = replay["failover"], tier["failover"]
    if r.get("kill_to_next_token_s") and t.get("kill_to_next_token_s"):
        print(f"failover, {args.context}-token context: kill to next token {r['kill_to_next_token_s']:.2f} s "
              f"replay, {t['kill_to_next_token_s']:.2f} s tier "
              f"({t['kill_to_next_token_s'] / r['kill_to_next_token_s']:.1%} of replay; "
              f"median gap before {t['median_gap_before_s']:.3f} s); same tokens with the "
              f"tier: {t['same_tokens']}")
    rp, tp = replay["shared_prefix"]["ttft_s"], tier["shared_prefix"]["ttft_s"]
    if rp and tp:
        print(f"TTFT of a {args.prefix}-token prefix another worker computed: {rp:.2f} s miss, "
              f"{tp:.2f} s tier ({rp / tp:.1f}x)")
    return 0 if t.get("same_tokens") and not t.get("error") else 1


if __name__ == "__main__":
    sys.exit(main())
