"""What a running CPU profile costs the worker: engine step time with and without the sampling
profiler (common/introspection.py, as `zeroserve debug profile --worker` runs it in a worker)
sampling the process, in alternating windows.

The profiler is a thread of the engine's own process, so it takes the GIL from the engine
thread at every sample; that is the overhead a worker pays while it is profiled. This runs
an Engine in-process (the default model on the CPU, or `--backend fake`: no forward, so the
engine's pure-Python step, the worst case for a sampler), keeps `--seqs` sequences decoding,
and times every `step()` in windows of `--window` seconds: off, on, off, on, ... (`--repeats`
pairs). Quoted: the median step time of each window kind, and their ratio.

    python scripts/bench_debug_overhead.py --seqs 16 --window 4 --repeats 3
    python scripts/bench_debug_overhead.py --backend fake --seqs 256 --window 2 --repeats 6
    python scripts/bench_debug_overhead.py --backend fake --fake-forward-ms 20 --seqs 256 \
        --window 2 --repeats 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def build_engine(backend: str, num_seqs: int, forward_ms: float = 0.0):
    from zeroserve.worker.config import EngineConfig
    from zeroserve.worker.engine import Engine
    from zeroserve.worker.fake_runner import FakeRunner

    if backend == "fake":
        config = EngineConfig(model="fake", max_num_seqs=num_seqs, num_kv_blocks=num_seqs * 80)
        return Engine(config, runner=FakeRunner(config, check_plans=False,
                                                forward_time_s=forward_ms / 1000))
    config = EngineConfig(model="default", device="cpu", max_num_seqs=num_seqs)
    return Engine(config)


def keep_busy(engine, num_seqs: int, counter: list[int]) -> None:
    """Top the engine up to num_seqs decoding sequences (short prompts, long outputs)."""
    from zeroserve.worker.sequence import SamplingParams

    while engine.stats().num_running + engine.stats().num_waiting < num_seqs:
        counter[0] += 1
        engine.add_request(f"r{counter[0]}", list(range(10, 26)),
                           SamplingParams(max_tokens=1000, ignore_eos=True))


def window(engine, num_seqs: int, seconds: float, counter: list[int]) -> list[float]:
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        keep_busy(engine, num_seqs, counter)
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return times


def sample(hz: int, seconds: float, stop: threading.Event, into: dict) -> None:
    from zeroserve.common.introspection import SamplingProfiler

    into["p"] = SamplingProfiler(hz).run(seconds, stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["default", "fake"], default="default")
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--window", type=float, default=4.0, help="seconds per window")
    parser.add_argument("--repeats", type=int, default=3, help="off/on pairs")
    parser.add_argument("--hz", type=int, default=100)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--fake-forward-ms", type=float, default=0.0,
                        help="with --backend fake: device time per step, slept out (the GIL "
                             "is free meanwhile, as during a GPU's forward)")
    args = parser.parse_args()

    engine = build_engine(args.backend, args.seqs, args.fake_forward_ms)
    counter = [0]
    for _ in range(args.warmup_steps):  # prefills done, caches hot
        keep_busy(engine, args.seqs, counter)
        engine.step()
    medians: dict[str, list[float]] = {"off": [], "on": []}
    overheads = []
    for _ in range(args.repeats):
        for kind in ("off", "on"):
            stop = threading.Event()
            profile = {}
            if kind == "on":
                sampler = threading.Thread(target=sample, daemon=True,
                                           args=(args.hz, args.window + 5, stop, profile))
                sampler.start()
            times = window(engine, args.seqs, args.window, counter)
            stop.set()
            if kind == "on":
                sampler.join()
                overheads.append(100 * profile["p"].sampling_s / profile["p"].wall_s)
            medians[kind].append(statistics.median(times))
            print(f"{kind:>3}: {len(times)} steps, median {1000 * medians[kind][-1]:.2f} ms",
                  flush=True)
    off, on = statistics.median(medians["off"]), statistics.median(medians["on"])
    print(f"backend={args.backend} forward={args.fake_forward_ms}ms seqs={args.seqs} "
          f"hz={args.hz}: step median off "
          f"{1000 * off:.2f} ms, on {1000 * on:.2f} ms, on/off {on / off:.3f}; the sampler "
          f"itself used {statistics.median(overheads):.2f}% of a core")


if __name__ == "__main__":
    main()
