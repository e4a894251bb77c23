"""The fp32 decode projections: the native block kernels against torch's dense fp32 product.

Every projection of a SmolLM2-135M-shaped model (30 layers of QKV 960x576, O 576x576,
gate/up 3072x576, down 576x1536; the tied 49152x576 lm_head), each layer with its own
weights so that they stream from memory as in serving, not from cache. For each row count
the dense fp32 product (F.linear on the dequantized weights, what fp32 decode rows ran
before) and the block kernels (worker/csrc/lowbit_matmul.cpp: q4 for the layers, q8 for the
lm_head) are timed in turn, `--rounds` times; medians of each round's median.

    python scripts/bench_block_kernels.py --rows 1 4 16 32 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zeroserve.worker import cpu_kernels  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
VOCAB, HIDDEN, LAYERS = 49152, 576, 30


def timed(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels.load(required=True)
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layer = []
        for rows, cols in LAYER_SHAPES:
            # The kernels' panel layout (lowbit_matmul.cpp): 16 features per panel.
            panels = rows // 16
            nibbles = torch.randint(0, 256, (panels, cols * 8), dtype=torch.uint8, generator=gen)
            scales = torch.rand(panels, cols // 2, generator=gen) * 0.01
            offsets = torch.randn(panels, cols // 2, generator=gen) * 0.01
            dense = torch.randn(rows, cols, generator=gen)
            layer.append((dense, nibbles, scales, offsets))
        layers.append(layer)
    head_dense = torch.randn(VOCAB, HIDDEN, generator=gen)
    head_q = torch.randint(-127, 128, (VOCAB // 16, HIDDEN * 16), dtype=torch.int8, generator=gen)
    head_scales = torch.rand(VOCAB // 16, HIDDEN // 2, generator=gen) * 0.01

    print(f"threads={args.threads}; ms per call of all 30 layers' projections / of the lm_head")
    print("| rows | layers dense fp32 | layers q4 | dense / q4 | lm_head dense fp32 | lm_head q8 | dense / q8 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        xs = {n: torch.randn(rows, n, generator=gen) for n in (576, 1536)}

        def dense_layers(xs=xs):
            for layer in layers:
                for dense, *_ in layer:
                    F.linear(xs[dense.shape[1]], dense)

        def q4_layers(xs=xs):
            for layer in layers:
                for dense, nibbles, scales, offsets in layer:
                    kernels.q4_matmul(xs[dense.shape[1]], nibbles, scales, offsets,
                                      dense.shape[0])

        x = xs[576]
        figures = {"dense": [], "q4": [], "head_dense": [], "q8": []}
        for _ in range(args.rounds):
            figures["dense"].append(timed(dense_layers, args.repeats))
            figures["q4"].append(timed(q4_layers, args.repeats))
            figures["head_dense"].append(timed(lambda x=x: F.linear(x, head_dense), args.repeats))
            figures["q8"].append(timed(lambda x=x: kernels.q8_matmul(x, head_q, head_scales,
                                                                     VOCAB), args.repeats))
        m = {k: statistics.median(v) for k, v in figures.items()}
        print(f"| {rows} | {m['dense']:.1f} | {m['q4']:.1f} | {m['dense'] / m['q4']:.2f}x "
              f"| {m['head_dense']:.1f} | {m['q8']:.1f} | {m['head_dense'] / m['q8']:.2f}x |")


if __name__ == "__main__":
    main()
