"""What the 128-row dense tiles of `--batch-invariant` cost a prefill chunk, per chunk size.

On a CPU whose dense bf16 kernel is not row-independent (no native bf16), the invariant mode
runs prefill rows in calls of exactly TILE_ROWS rows, the last one padded
(worker/model/batch_invariance.py); the default mode makes one call. This times one layer's
four projections of the default model's shapes (576 hidden, 1536 intermediate) both ways,
alternated, in process CPU time (one thread by default: a shared machine's other load then
adds no spinning threads' time), and prints the medians per chunk size.

    python scripts/bench_tile_padding.py --rows 40,130,200,416
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zeroserve.worker.model.batch_invariance import TILE_ROWS, tiled_linear  # noqa: E402

# [out, in] of one SmolLM2-135M layer's fused projections: qkv, o_proj, gate_up, down.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="40,130,200,416", help="prefill chunk sizes")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    weights = [torch.randn(shape).bfloat16() for shape in SHAPES]
    print(f"bf16, {args.threads} thread(s), tiles of {TILE_ROWS}")
    print("| rows | one call, CPU ms | tiles, CPU ms | tiles / one call |")
    print("| ---: | ---: | ---: | ---: |")
    for rows in (int(r) for r in args.rows.split(",")):
        times: dict[str, list[float]] = {"one call": [], "tiles": []}
        for repeat in range(args.repeats):
            modes = ("one call", "tiles") if repeat % 2 == 0 else ("tiles", "one call")
            for mode in modes:
                xs = [torch.randn(rows, w.shape[1]).bfloat16() for w in weights]
                started = time.process_time()
                for x, w in zip(xs, weights, strict=True):
                    if mode == "tiles":
                        tiled_linear(x, w, TILE_ROWS)
                    else:
                        F.linear(x, w)
                times[mode].append((time.process_time() - started) * 1e3)
        one, tiles = statistics.median(times["one call"]), statistics.median(times["tiles"])
        print(f"| {rows} | {one:.1f} | {tiles:.1f} | {tiles / one:.2f} |", flush=True)


if __name__ == "__main__":
    main()
