"""What verifying k drafts costs: the model runner's time for one sequence's decode step with
1 + k rows (its token and k drafts) against a plain 1-row step, over a cached context.

The runner alone (no scheduler, no gateway), the default model and flags (`--dtype auto`,
torch's threads); rounds alternate the row counts so a load change hits them all alike.
worker/draft_policy.py's ROW_COST comes from this table.

    python scripts/bench_verify_step.py --context 300 --drafts 0,1,2,4,8,12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zeroserve.worker.config import EngineConfig  # noqa: E402
from zeroserve.worker.model_runner import ModelRunner  # noqa: E402
from zeroserve.worker.plan import ScheduledChunk, SchedulerOutput  # noqa: E402
from zeroserve.worker.sequence import SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=300, help="tokens already cached")
    ap.add_argument("--drafts", default="0,1,2,3,4,5,6,7,8,12")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    ks = [int(k) for k in args.drafts.split(",")]
    block_size = 16
    num_blocks = (args.context + max(ks) + 1) // block_size + 1
    runner = ModelRunner(EngineConfig(num_kv_blocks=num_blocks, block_size=block_size))
    params = SamplingParams(temperature=0.0, max_tokens=4096)
    table = list(range(num_blocks))
    prompt = [(i * 37) % 5000 + 10 for i in range(args.context)]
    runner.execute(SchedulerOutput([ScheduledChunk("r", prompt, 0, table, True, params,
                                                   prompt, [])]))

    def step(k: int) -> tuple[float, float, float, float]:
        drafts = [11 + i for i in range(k)]
        chunk = ScheduledChunk("r", [5, *drafts], args.context, table, True, params, prompt,
                               [], drafts or None)
        started = time.perf_counter()
        runner.execute(SchedulerOutput([chunk]))
        t = runner.last_timing
        return time.perf_counter() - started, t.prepare_s, t.forward_s, t.sample_s

    for k in ks * 3:  # warm-up
        step(k)
    times: dict[int, list[tuple[float, ...]]] = {k: [] for k in ks}
    for _ in range(args.rounds):
        for k in ks:
            times[k].append(step(k))
    base = statistics.median(t[0] for t in times[ks[0]])
    print(f"{runner.info.name}, {runner.info.dtype}, context {args.context}; medians of "
          f"{args.rounds} (relative to k={ks[0]})")
    for k in ks:
        total, prepare, forward, sample = (statistics.median(t[i] for t in times[k]) * 1e3
                                           for i in range(4))
        print(f"k={k:2d} ({k + 1:2d} rows): {total:6.2f} ms = {total / (base * 1e3):4.2f}x  "
              f"(prepare {prepare:.2f}, forward {forward:.2f}, sample {sample:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
