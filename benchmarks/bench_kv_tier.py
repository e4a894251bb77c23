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

`--rolling`: a rolling restart of two workers under long streams, tier off then on:
`--streams` (8) streams of `--rolling-context`-token prompts (random, the same in both
modes); once each has its first tokens, worker-0 and then worker-1 are restarted as
`zeroserve workers restart --all --deadline D` does (cli/admin_client.py: the next once the
last is ready again); once every stream made `--tokens-after` more tokens, they hang up.
Reported per stream: the longest gap between two of its tokens from the restart on; and
the max over streams, the restart's seconds, the tier's hits.

`--cost`: what the tier costs when nothing is reused: `serve` (one worker) at `--clients`
clients on bench_serving's chat prompts, output tokens/s and server CPU per token, tier off
and on alternated `--repeats` times (benchmarks/bench_commits.py's measurement). Each
tier-on server gets a new, empty tier folder, removed after: the tier outlives its workers
(in /dev/shm by default), and a folder an earlier run filled would give hits.
`--cost-engine`: the same in one process: an engine on the default model runs `--clients`
distinct prompts at once, tier off and on alternated; the least CPU and wall seconds per
output token, and their ratio.

`--write-through`: the per-step write-through cost in one process, on the default model's
block shape (bf16, 30 layers): `--wt-blocks` full blocks reported and flushed per step, the
pool copied into the tier (a CUDA worker's way, or --no-kv-pool-in-tier) against the pool
living in the tier (a CPU worker's default: nothing copied, an entry per block). Reported per
block, the least of `--repeats` x 5 steps: the step thread's CPU (on_full + flush) and the
whole process's (the writer thread's crc32 and file writes too).
`--cost --compare-pool`: the served cost in three alternated modes, tier off, tier on with
the pool copied in (--no-kv-pool-in-tier), tier on with the pool in it.

Every tier-on server here gets a new tier folder under /dev/shm, removed with the server.

    python benchmarks/bench_kv_tier.py                       # default model, ~6k context
    python benchmarks/bench_kv_tier.py --context 1500 --prefix 1000   # quicker
    python benchmarks/bench_kv_tier.py --rolling             # 8 streams, 2,000-token prompts
    python benchmarks/bench_kv_tier.py --cost --clients 16   # the cost, no reuse
    python benchmarks/bench_kv_tier.py --write-through       # copy vs pool in the tier
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import re
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

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None  # where the tier lives by default
TOKEN_RANGE = (1000, 30000)  # ordinary tokens of the default model's vocabulary
BLOCK = 16  # tokens per KV block (--block-size's default)


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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=600,
                              json={**body, "stream": True}) as response:
                for line in response.iter_lines():
                    if self._stop.is_set():
                        break  # closing the connection aborts the request
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

    def stop(self) -> None:
        """Stop reading at the next line and hang up."""
        self._stop.set()


def wait_until(predicate, timeout_s: float, what: str) -> bool:
    """Poll until predicate() holds (True), or raise TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    raise TimeoutError(what)


def tier_hits(server) -> dict[str, float]:
    """Each worker's blocks loaded from the tier so far, from the gateway's /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^zeroserve:kv_tier_hits_total\{[^}]*worker_id="([^"]+)"[^}]*\} (\S+)$', text,
        re.MULTILINE)}


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
    hits_before = sum(tier_hits(server).values())
    second = Stream(server.url, {"prompt": prefix + random_prompt(rng, 8), "max_tokens": 1,
                                 "temperature": 0})
    second.join(900)
    # Heartbeats carry the counters: the restarted worker's hits show within a beat or two.
    with contextlib.suppress(TimeoutError):  # fewer hits: reported as they are
        wait_until(lambda: args.tier_dir is None or sum(tier_hits(server).values())
                   - hits_before >= args.prefix // BLOCK, 30, "tier hits reported")
    return {"ttft_s": (second.times[0] - second.started) if second.times else None,
            "tier_hit_blocks": sum(tier_hits(server).values()) - hits_before,
            "prefix_blocks": args.prefix // BLOCK, "error": second.error}


@contextlib.contextmanager
def serving(args, tier_size: float, max_model_len: int, num_workers: int = 2):
    """`zeroserve serve --workers N`, with the tier in a new folder of its own (in /dev/shm,
    where the tier lives by default) when tier_size > 0: the tier outlives its workers, so a
    folder a run before us filled would give hits. The folder goes with the server."""
    folder = tempfile.mkdtemp(prefix="bench-kv-tier-")
    tier = tempfile.mkdtemp(prefix="bench-kv-tier-", dir=SHM) if tier_size else None
    args.tier_dir = None if tier is None else os.path.join(tier, "kv")
    flags = ["--device", "cpu", "--workers", str(num_workers),
             "--max-model-len", str(max_model_len), *args.server_args]
    if tier_size:
        flags += ["--kv-offloading-size", str(tier_size), "--kv-offloading-dir", args.tier_dir]
    server = start_server(Path(folder), args=tuple(flags), num_workers=num_workers,
                          timeout_s=600)
    try:
        yield server
    finally:
        server.stop(timeout_s=30)
        if tier is not None:
            shutil.rmtree(tier, ignore_errors=True)
        print(f"(server log: {server.log_path})", file=sys.stderr, flush=True)


def run_mode(args, tier_size: float) -> dict:
    rng = random.Random(args.seed)
    with serving(args, tier_size, max(args.context, args.prefix) + args.max_tokens + 64) \
            as server:
        result = {"mode": "tier" if tier_size else "replay",
                  "failover": failover(server, args, rng),
                  "shared_prefix": shared_prefix(server, args, rng)}
    print(json.dumps(result), flush=True)
    return result


def rolling(server, args, rng: random.Random) -> dict:
    """`--streams` streams of `--rolling-context`-token prompts; once each has tokens, a
    rolling restart (cli/admin_client.py's, what `zeroserve workers restart --all` runs):
    worker-0, then worker-1 once worker-0 is ready again. Then, once every stream has made
    `--tokens-after` more tokens, they hang up. Per stream: the longest gap between two of
    its tokens from the restart on, and the median gap before it."""
    from zeroserve.cli.admin_client import AdminClient, rolling_restart

    streams = [Stream(server.url, {"prompt": random_prompt(rng, args.rolling_context),
                                   "max_tokens": args.rolling_max_tokens, "temperature": 0,
                                   "ignore_eos": True}) for _ in range(args.streams)]
    wait_until(lambda: all(len(s.times) >= 3 or s.is_done for s in streams), 7200,
               "every stream's first tokens")
    hits_before = sum(tier_hits(server).values())
    started = time.monotonic()
    said: list[str] = []
    rolling_restart(AdminClient(server.url), args.rolling_deadline, 900,
                    lambda line: said.append(f"{time.monotonic() - started:.1f}s {line}"))
    restarted_s = time.monotonic() - started
    counts = [len(s.times) for s in streams]
    wait_until(lambda: all(len(s.times) >= n + args.tokens_after or s.is_done
                           for s, n in zip(streams, counts, strict=True)), 7200,
               "tokens after the restart")
    finished_early = [s.is_done for s in streams]  # ran out of max_tokens: raise it
    for stream in streams:
        stream.stop()
    for stream in streams:
        stream.join(60)
    per_stream = []
    for stream, is_early in zip(streams, finished_early, strict=True):
        pairs = list(itertools.pairwise(stream.times))
        before = [b - a for a, b in pairs if b < started]
        during = [(b - a, a - started) for a, b in pairs if b >= started]
        longest = max(during) if during else (None, None)
        per_stream.append({"longest_gap_s": round(longest[0], 3) if during else None,
                           # when it began, from the restart's start (its log: restart_log)
                           "longest_gap_from_s": round(longest[1], 1) if during else None,
                           "median_gap_before_s": round(statistics.median(before), 4)
                           if before else None, "num_tokens": len(stream.times),
                           "finished_early": is_early, "error": stream.error})
    longest = [s["longest_gap_s"] for s in per_stream if s["longest_gap_s"] is not None]
    return {"restart_s": round(restarted_s, 1), "restart_log": said,
            "longest_gap_s": max(longest) if longest else None, "streams": per_stream,
            "tier_hit_blocks": sum(tier_hits(server).values()) - hits_before}


def run_rolling(args, tier_size: float) -> dict:
    rng = random.Random(args.seed)  # the same prompts in both modes
    with serving(args, tier_size, args.rolling_context + args.rolling_max_tokens + 64) \
            as server:
        result = {"mode": "tier" if tier_size else "replay", "loadavg": os.getloadavg(),
                  "rolling": rolling(server, args, rng)}
    print(json.dumps(result), flush=True)
    return result


def main_rolling(args) -> int:
    replay = run_rolling(args, 0.0)
    tier = run_rolling(args, args.tier_size)
    print(f"rolling restart of 2 workers under {args.streams} streams of "
          f"{args.rolling_context}-token prompts (deadline {args.rolling_deadline:g} s), "
          "longest gap of each stream, s:")
    for result in (replay, tier):
        r = result["rolling"]
        gaps = " ".join(f"{s['longest_gap_s']}" for s in r["streams"])
        num_errors = sum(1 for s in r["streams"] if s["error"])
        print(f"  {result['mode']:<6} max {r['longest_gap_s']} | {gaps} | restart took "
              f"{r['restart_s']} s, tier hits {r['tier_hit_blocks']:.0f} blocks, load "
              f"{result['loadavg'][0]:.1f}" + (f", {num_errors} stream(s) failed (in the JSON "
                                               "line above)" if num_errors else ""))
    # A replayed stream may fail (the gateway's request_idle_timeout_s while it waits for its
    # recompute): a finding of the run. The tier's must not.
    return 1 if any(s["error"] for s in tier["rolling"]["streams"]) else 0


def cost(args) -> int:
    """Output tokens/s of `zeroserve serve` at `--clients` clients (bench_serving's chat
    prompts, benchmarks/bench_commits.py's measurement), tier off and on alternated, each
    repeat in the other order; every tier-on server gets a new, empty tier folder (removed
    after), so nothing a run before it wrote is found: the tier costs its write-through and
    its lookups, and gives nothing back."""
    from benchmarks.bench_commits import Side, Teardown, serve_and_measure
    from benchmarks.bench_data import load_chat_samples
    from benchmarks.bench_serving import BenchConfig

    cfg = BenchConfig(num_prompts=args.num_prompts, concurrency=args.clients,
                      output_len=args.output_len, seed=args.seed, show_progress=False)
    samples = load_chat_samples(args.num_prompts, args.seed,
                                max_prompt_tokens=cfg.max_prompt_tokens)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-kv-tier-cost-"))
    teardown = Teardown()
    teardown.install()
    modes = ("off", "copy", "on") if args.compare_pool else ("off", "on")
    runs: dict[str, list] = {mode: [] for mode in modes}
    try:
        for repeat in range(args.repeats):
            for mode in (modes if repeat % 2 == 0 else modes[::-1]):
                flags = tuple(args.server_args)
                tier = None
                if mode != "off":
                    tier = tempfile.mkdtemp(prefix="bench-kv-tier-cost-", dir=SHM)
                    flags += ("--kv-offloading-size", str(args.tier_size),
                              "--kv-offloading-dir", os.path.join(tier, "kv"))
                if mode == "copy":
                    flags += ("--no-kv-pool-in-tier",)
                try:
                    run = serve_and_measure(Side(mode, ".", flags), repeat, cfg, samples,
                                            log_dir, 600, teardown)
                finally:
                    if tier is not None:
                        shutil.rmtree(tier, ignore_errors=True)
                runs[mode].append(run)
                print(json.dumps({"mode": mode, "repeat": repeat,
                                  "output_tok_s": run.summary.get("output_throughput"),
                                  "cpu_ms_per_token": run.cpu_ms_per_token,
                                  "loadavg": run.summary.get("loadavg")}), flush=True)
    finally:
        teardown.run()
    ratios = [on.summary["output_throughput"] / off.summary["output_throughput"]
              for on, off in zip(runs["on"], runs["off"], strict=True)
              if on.summary.get("output_throughput") and off.summary.get("output_throughput")]
    cpu = [on.cpu_ms_per_token / off.cpu_ms_per_token
           for on, off in zip(runs["on"], runs["off"], strict=True)
           if on.cpu_ms_per_token and off.cpu_ms_per_token]
    load = os.getloadavg()[0]
    print(f"tier on / off, {args.clients} clients, nothing reused (a new tier folder per "
          f"run): output tok/s {_ratios(ratios)}, CPU per output token {_ratios(cpu)} "
          f"(load {load:.1f} at the end; server logs in {log_dir})")
    if args.compare_pool:
        for name, other in (("copied / off", "off"), ("pool in tier / copied", "copy")):
            base = runs["copy"] if name.startswith("copied") else runs["on"]
            tok = [a.summary["output_throughput"] / b.summary["output_throughput"]
                   for a, b in zip(base, runs[other], strict=True)
                   if a.summary.get("output_throughput") and b.summary.get("output_throughput")]
            per = [a.cpu_ms_per_token / b.cpu_ms_per_token
                   for a, b in zip(base, runs[other], strict=True)
                   if a.cpu_ms_per_token and b.cpu_ms_per_token]
            print(f"{name}: output tok/s {_ratios(tok)}, CPU per output token {_ratios(per)}")
    return 0 if ratios else 1


def _ratios(values: list[float]) -> str:
    if not values:
        return "n/a"
    return (f"median {statistics.median(values):.3f}x ("
            + ", ".join(f"{v:.3f}" for v in values) + ")")


def cost_engine(args) -> int:
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


def write_through(args) -> int:
    """The write-through's CPU per block, the pool copied into the tier against the pool in
    the tier, on the default model's block shape; min of repeats, alternated."""
    import torch

    from zeroserve.worker.block_manager import BlockManager
    from zeroserve.worker.kv_tier.connector import KVTierConnector
    from zeroserve.worker.kv_tier.store import TierLevel, TierStore
    from zeroserve.worker.sequence import SamplingParams, Sequence

    layers, heads, dim, dtype = 30, 3, 64, torch.bfloat16  # SmolLM2-135M, bf16 KV
    num_blocks, per_step = 4 * args.wt_blocks, args.wt_blocks
    shape = (layers, 2, num_blocks, BLOCK, heads, dim)
    root = tempfile.mkdtemp(prefix="bench-kv-tier-wt-", dir=SHM)
    key = bytes(16)
    connectors = {}
    for mode in ("copy", "pool"):
        level = TierLevel(os.path.join(root, mode), 8 << 30, key)
        made = None
        if mode == "pool":
            made = level.create_pool(num_blocks, layers * 2, BLOCK * heads * dim * 2)
            pool = torch.frombuffer(made.mapped, dtype=dtype, count=torch.Size(shape).numel(),
                                    offset=made.data_offset).view(shape)
        else:
            pool = torch.empty(shape, dtype=dtype)
        pool.copy_(torch.randn(shape).to(dtype))
        bm = BlockManager(num_blocks, BLOCK)
        connectors[mode] = KVTierConnector(TierStore([level]), pool, key, bm.block_tokens,
                                           pool_file=made)
    rng = random.Random(args.seed)
    best: dict[str, tuple[float, float]] = {}
    for repeat in range(args.repeats * 5):
        for mode in (("copy", "pool") if repeat % 2 == 0 else ("pool", "copy")):
            tier = connectors[mode]
            seq = Sequence(f"r{repeat}{mode}", random_prompt(rng, per_step * BLOCK + 1),
                           SamplingParams(max_tokens=1))
            table = rng.sample(range(num_blocks), per_step)
            cpu0, step0 = time.process_time(), time.thread_time()
            tier.on_full(seq, 0, per_step, table)
            tier.flush()
            step = time.thread_time() - step0
            tier.wait_written(timeout_s=300)
            cpu = time.process_time() - cpu0
            assert tier.counters.num_puts == per_step * (repeat + 1), "blocks were dropped"
            old = best.get(mode, (float("inf"), float("inf")))
            best[mode] = (min(old[0], step / per_step), min(old[1], cpu / per_step))
    for tier in connectors.values():
        tier.close()
    shutil.rmtree(root, ignore_errors=True)
    block_kib = connectors["copy"].block_bytes >> 10
    for mode, (step, cpu) in best.items():
        print(json.dumps({"mode": mode, "blocks_per_step": per_step, "block_kib": block_kib,
                          "step_thread_us_per_block": round(step * 1e6, 1),
                          "process_cpu_us_per_block": round(cpu * 1e6, 1)}), flush=True)
    (cs, cc), (ps, pc) = best["copy"], best["pool"]
    print(f"write-through per block ({block_kib} KiB, {per_step} per step, min of "
          f"{args.repeats * 5}): step thread {cs * 1e6:.1f} -> {ps * 1e6:.1f} us "
          f"({ps / cs:.2f}x), whole process {cc * 1e6:.1f} -> {pc * 1e6:.1f} us "
          f"({pc / cc:.2f}x), copied -> pool in the tier")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=6000)
    parser.add_argument("--prefix", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--chunks-before-kill", type=int, default=10)
    parser.add_argument("--tier-size", type=float, default=2.0, help="GiB")
    parser.add_argument("--seed", type=int, default=37)
    parser.add_argument("--cost", action="store_true",
                        help="the tier's cost when nothing is reused: served output tok/s")
    parser.add_argument("--cost-engine", action="store_true",
                        help="the same in one engine, in-process: CPU and wall per token")
    parser.add_argument("--compare-pool", action="store_true",
                        help="--cost: off, the pool copied in, and the pool in the tier")
    parser.add_argument("--write-through", action="store_true",
                        help="the write-through's CPU per block: copied against pool in tier")
    parser.add_argument("--wt-blocks", type=int, default=64, help="--write-through: per step")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=48, help="--cost")
    parser.add_argument("--output-len", type=int, default=128, help="--cost")
    parser.add_argument("--prompt-len", type=int, default=200, help="--cost-engine")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rolling", action="store_true",
                        help="a rolling restart of 2 workers under long streams")
    parser.add_argument("--streams", type=int, default=8, help="--rolling")
    parser.add_argument("--rolling-context", type=int, default=2000, help="--rolling")
    parser.add_argument("--rolling-max-tokens", type=int, default=2000, help="--rolling")
    parser.add_argument("--rolling-deadline", type=float, default=0.0,
                        help="--rolling: `workers restart --deadline`")
    parser.add_argument("--tokens-after", type=int, default=10,
                        help="--rolling: tokens every stream makes after the restart")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args(argv)
    if args.cost:
        return cost(args)
    if args.cost_engine:
        return cost_engine(args)
    if args.write_through:
        return write_through(args)
    if args.rolling:
        return main_rolling(args)
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
    hits = tier["shared_prefix"]
    is_refound = hits["tier_hit_blocks"] >= hits["prefix_blocks"]
    if rp and tp:
        print(f"TTFT of a {args.prefix}-token prefix another worker computed: {rp:.2f} s miss, "
              f"{tp:.2f} s tier ({rp / tp:.1f}x); after the restart the tier gave "
              f"{hits['tier_hit_blocks']:.0f} blocks of the prefix's {hits['prefix_blocks']}")
    return 0 if t.get("same_tokens") and not t.get("error") and is_refound else 1


if __name__ == "__main__":
    sys.exit(main())
