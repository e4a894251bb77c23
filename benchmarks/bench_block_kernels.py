"""The fp32 decode projections: the native block kernels against torch's dense fp32 product.

Every projection of a SmolLM2-135M-shaped model (30 layers of QKV 960x576, O 576x576,
gate/up 3072x576, down 576x1536; the tied 49152x576 lm_head), each layer with its own
weights so that they stream from memory as in serving, not from cache. For each row count
the dense fp32 product (F.linear on the dequantized weights, what fp32 decode rows ran
before) and the block kernels (worker/csrc/lowbit_matmul.cpp: q4 for the layers, q8 for the
lm_head) are timed in turn, `--rounds` times; medians of each round's median.

    python benchmarks/bench_block_kernels.py --rows 1 4 16 32 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zeroserve.worker import cpu_kernels  # noqa: E402
from zeroserve.worker.model.quant import (  # noqa: E402
    BlockQ4,
    BlockQ8,
    Int4Blocks,
    Int8Blocks,
)

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
    parser.add_argument("--fp32-scales", action="store_true",
                        help="scales that fp16 cannot hold (Q4_K's): the 384-byte q4 unit")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels.load(required=True)
    rng = np.random.default_rng(0)
    scale_dtype = np.float32 if args.fp32_scales else np.float16

    def scales(rows: int, cols: int, size: float) -> np.ndarray:
        return (rng.random((rows, cols // 32)) * size).astype(scale_dtype).astype(np.float32)

    def q4(rows: int, cols: int) -> torch.Tensor:
        """BlockQ4's layout of random Q4_1-like blocks (fp16 scales and offsets, as the file
        stores them, unless --fp32-scales)."""
        q = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
        scale = scales(rows, cols, 0.01)
        return BlockQ4.tensors(Int4Blocks(q, scale, scales(rows, cols, 0.01) + 8 * scale))

    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layer = []
        for rows, cols in LAYER_SHAPES:
            layer.append((torch.randn(rows, cols, generator=gen), q4(rows, cols)))
        layers.append(layer)
    head_dense = torch.randn(VOCAB, HIDDEN, generator=gen)
    head_q8 = BlockQ8.tensors(Int8Blocks(
        rng.integers(-127, 128, (VOCAB, HIDDEN), dtype=np.int8), scales(VOCAB, HIDDEN, 0.01)))
    print(f"q4 unit {layers[0][0][1].shape[2]} bytes, q8 unit {head_q8.shape[2]} bytes")

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
                for dense, blocks in layer:
                    kernels.q4_matmul(xs[dense.shape[1]], blocks, dense.shape[0])

        x = xs[576]
        figures = {"dense": [], "q4": [], "head_dense": [], "q8": []}
        for _ in range(args.rounds):
            figures["dense"].append(timed(dense_layers, args.repeats))
            figures["q4"].append(timed(q4_layers, args.repeats))
            figures["head_dense"].append(timed(lambda x=x: F.linear(x, head_dense), args.repeats))
            figures["q8"].append(timed(lambda x=x: kernels.q8_matmul(x, head_q8, VOCAB), args.repeats))
        m = {k: statistics.median(v) for k, v in figures.items()}
        print(f"| {rows} | {m['dense']:.1f} | {m['q4']:.1f} | {m['dense'] / m['q4']:.2f}x "
              f"| {m['head_dense']:.1f} | {m['q8']:.1f} | {m['head_dense'] / m['q8']:.2f}x |")


if __name__ == "__main__":
    main()
