"""The decode step eager against compiled (worker/model/compiled.py), alternated in one process.

One ModelRunner with the compiled step built (`enforce_eager=False`); each round times
`--steps` decode steps per batch size with the compiled step switched off (eager) and on, in
turn, so both see the same machine. Every sequence has `--context` tokens of context (the
pool content does not matter for timing), one decode token per step, greedy sampling.

    python scripts/bench_compiled.py --batch 1 16 --rounds 3 --steps 20
    python scripts/bench_compiled.py --dtype bfloat16 --batch 1 16

Prints ms per step (median of the steps, per round) and the ratio eager / compiled, and the
start-up phases (`compile` is the compile or cache load).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.profile_runner import decode_plan  # noqa: E402
from zeroserve.worker.config import EngineConfig  # noqa: E402
from zeroserve.worker.model_runner import ModelRunner  # noqa: E402
from zeroserve.worker.sequence import SamplingParams  # noqa: E402
from zeroserve.worker.startup import StartupTimer  # noqa: E402


def time_steps(runner: ModelRunner, plan, steps: int) -> float:
    for _ in range(2):
        runner.execute(plan)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        runner.execute(plan)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    timer = StartupTimer()
    runner = ModelRunner(EngineConfig(dtype=args.dtype, num_kv_blocks=2000, enforce_eager=False,
                                      max_num_seqs=max(args.batch)), timer)
    compiled = runner.decode_step
    if compiled is None:
        sys.exit("the compiled step could not be built here (see the log)")
    print(f"dtype={runner.info.dtype} threads={torch.get_num_threads()} context={args.context} "
          f"start-up phases {timer.rounded()}")
    params = SamplingParams(temperature=0.0, max_tokens=10**6)
    for batch in args.batch:
        plan = decode_plan(batch, args.context, runner.block_size, params, runner.num_kv_blocks)
        ratios = []
        for round_ in range(args.rounds):
            figures = {}
            for name, step in (("eager", None), ("compiled", compiled)):
                runner.decode_step = step
                figures[name] = time_steps(runner, plan, args.steps)
            ratios.append(figures["eager"] / figures["compiled"])
            print(f"batch {batch:3d} round {round_}: eager {figures['eager']:7.2f} ms/step, "
                  f"compiled {figures['compiled']:7.2f} ms/step, "
                  f"eager/compiled {ratios[-1]:.3f}", flush=True)
        print(f"batch {batch:3d}: median eager/compiled {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
