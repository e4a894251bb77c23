"""What batch independence costs: decode-step forward time with the small-batch kernels chosen
per row (decode rows int4, every sampled row the int8 lm_head: worker/model/linear.py) against
the old rule that chose them by the step's row count (int4 up to 24 rows, int8 up to 12).

One engine, one batch per size; the rule alternates step by step inside the batch, so both
see the same load on a shared machine. Prints median forward ms per rule and size.

    python scripts/bench_kernel_choice.py --sizes 16,32,48,64
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroserve.worker.config import EngineConfig  # noqa: E402
from zeroserve.worker.engine import Engine  # noqa: E402
from zeroserve.worker.model.linear import Linear  # noqa: E402
from zeroserve.worker.model.quant import PackedInt4  # noqa: E402
from zeroserve.worker.sequence import SamplingParams  # noqa: E402

PER_ROW = Linear.__call__


def by_row_count(self: Linear, x, num_packed_rows=None):
    """The rule before issue 14: the step's row count picked the kernel for every row."""
    limit = 24 if isinstance(self.packed, PackedInt4) else 12
    if self.packed is not None and x.shape[0] <= limit:
        return self.packed.mm(x)
    return F.linear(x, self.dense)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16,32,48,64")
    ap.add_argument("--steps", type=int, default=40, help="decode steps per batch")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    engine = Engine(EngineConfig(dtype="bfloat16", device="cpu", num_kv_blocks=4096,
                                 max_model_len=1024, max_num_seqs=max(sizes),
                                 enable_prefix_caching=False, num_threads=args.threads))
    rng = random.Random(0)
    print("| decode rows | per step count (old) ms | per row (new) ms | new / old |")
    print("| ---: | ---: | ---: | ---: |")
    for n in sizes:
        times: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(n):
            engine.add_request(f"{n}-{i}", [rng.randrange(100, 40000) for _ in range(40)],
                               SamplingParams(temperature=0, max_tokens=args.steps + 1,
                                              ignore_eos=True))
        step = 0
        while engine.has_unfinished():
            rule = "old" if step % 2 == 0 else "new"
            Linear.__call__ = by_row_count if rule == "old" else PER_ROW
            engine.step()
            timing = engine.runner.last_timing
            if timing.num_seqs == n and timing.num_tokens == n:  # pure decode, full batch
                times[rule].append(timing.forward_s * 1e3)
                step += 1
        Linear.__call__ = PER_ROW
        old, new = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"| {n} | {old:.1f} | {new:.1f} | {new / old:.2f} |", flush=True)


if __name__ == "__main__":
    main()
