"""What batch invariance costs in the forward: the two modes of worker/model/linear.py, alternated.

`--batch-invariant` (EngineConfig.batch_invariant) chooses the small-batch kernels per row
(decode rows int4, every sampled row the int8 lm_head) and, on a CPU whose dense bf16 kernel
is not row-independent, runs prefill rows in 128-row tiles; the default chooses by the call's
row count (int4 up to 24 rows, int8 up to 12) and runs the dense kernel untiled (on a CPU with
native bf16; on one without, it keeps the per-row choice untiled, which this script shows is
the faster there: its "row count" column is the rule forced).

One bf16 engine, one batch per size; the mode alternates step by step inside the batch (every
projection of the model switched), so both see the same load on a shared machine. Two kinds of
step are timed: pure decode steps of the full batch, and mixed steps where the batch decodes
beside a prefill chunk of new prompts (--prefill-tokens per prompt). Prints medians of the
forward's wall time and of the process CPU time per step, per mode and size.

    python scripts/bench_kernel_choice.py --sizes 16,32,48,64
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroserve.worker.config import EngineConfig  # noqa: E402
from zeroserve.worker.engine import Engine  # noqa: E402
from zeroserve.worker.model.batch_invariance import dense_tile_rows  # noqa: E402
from zeroserve.worker.model.linear import Linear  # noqa: E402
from zeroserve.worker.sequence import SamplingParams  # noqa: E402

MODES = ("row count", "invariant")


def linears(engine: Engine) -> list[Linear]:
    model = engine.runner.model
    return [model.lm_head] + [getattr(layer, name) for layer in model.layers
                              for name in ("qkv", "o_proj", "gate_up", "down")]


def set_mode(engine: Engine, mode: str, tile_rows: int | None) -> None:
    is_invariant = mode == "invariant"
    for linear in linears(engine):
        linear.per_row = is_invariant
        linear.tile_rows = tile_rows if is_invariant and linear.packed is not None else None


def add_requests(engine: Engine, prefix: str, n: int, prompt_len: int, max_tokens: int,
                 rng: random.Random) -> None:
    for i in range(n):
        engine.add_request(f"{prefix}-{i}", [rng.randrange(100, 40000) for _ in range(prompt_len)],
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16,32,48,64")
    ap.add_argument("--steps", type=int, default=40, help="decode steps per batch")
    ap.add_argument("--prefill-tokens", type=int, default=200,
                    help="prompt length of the requests that join mid-batch (mixed steps)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    engine = Engine(EngineConfig(dtype="bfloat16", device="cpu", num_kv_blocks=4096,
                                 max_model_len=1024, max_num_seqs=max(sizes) + 8,
                                 enable_prefix_caching=False, num_threads=args.threads,
                                 batch_invariant=True))
    tile_rows = dense_tile_rows(engine.runner.dtype, engine.runner.device)
    print(f"bf16, {args.threads} threads; dense tiles in the invariant mode: {tile_rows}")
    rng = random.Random(0)
    print("| step | rows | row count ms (CPU ms) | invariant ms (CPU ms) | invariant / row count |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for n in sizes:
        walls: dict[tuple[str, str], list[float]] = {}
        cpus: dict[tuple[str, str], list[float]] = {}
        add_requests(engine, f"{n}", n, 40, args.steps + 1, rng)
        step = joined = 0
        while engine.has_unfinished():
            mode = MODES[step % 2]
            set_mode(engine, mode, tile_rows)
            # Every 8th step two new prompts join: the next steps prefill beside the decodes.
            if step % 8 == 4 and joined < args.steps // 4:
                add_requests(engine, f"{n}-late{joined}", 2, args.prefill_tokens, 2, rng)
                joined += 1
            cpu = time.process_time()
            engine.step()
            cpu = time.process_time() - cpu
            timing = engine.runner.last_timing
            kind = ("decode" if timing.num_tokens == timing.num_seqs == n
                    else "mixed" if timing.num_tokens > timing.num_seqs >= n else None)
            if kind is not None:
                walls.setdefault((kind, mode), []).append(timing.forward_s * 1e3)
                cpus.setdefault((kind, mode), []).append(cpu * 1e3)
            step += 1
        for kind in ("decode", "mixed"):
            if not all((kind, m) in walls for m in MODES):
                continue
            w = {m: statistics.median(walls[kind, m]) for m in MODES}
            c = {m: statistics.median(cpus[kind, m]) for m in MODES}
            print(f"| {kind} | {n} | {w['row count']:.1f} ({c['row count']:.1f}) | "
                  f"{w['invariant']:.1f} ({c['invariant']:.1f}) | "
                  f"{w['invariant'] / w['row count']:.2f} "
                  f"({c['invariant'] / c['row count']:.2f}) |", flush=True)


if __name__ == "__main__":
    main()
