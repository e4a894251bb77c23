"""The fp32 decode projections: the native block kernels against torch's dense fp32 product.

Every projection of a SmolLM2-135M-shaped model (30 layers of QKV 960x576, O 576x576,
gate/up 3072x576, down 576x1536; the tied 49152x576 lm_head), each layer with its own
weights so that they stream from memory as in serving, not from cache. For each row count
the dense fp32 product (F.linear on the dequantized weights, what fp32 decode rows ran
before) and the block kernels (worker/csrc/lowbit_matmul.cpp: q4 for the layers, q8 for the
lm_head) are timed in turn, `--rounds` times; medians of each round's median.

    python benchmarks/bench_block_kernels.py --rows 1 4 16 32 --rounds 3

`--int8` times, instead, the same blocks with fp32 activations against int8 activations
(worker/csrc/lowbit_int8.cpp, what decode rows take with --int8-activations), interleaved
call by call, the minimum of each; `--accuracy` then also runs the real default model over a
prompt and reports, per projection kind, the largest difference between the two kernels'
outputs on the inputs the model's layers actually saw.

    python benchmarks/bench_block_kernels.py --int8 --rows 1 4 8 16 --accuracy

`--int8 --decode-steps` times whole decode steps of the real default model instead (fp32, an
Engine with and one without --int8-activations in this process, N sequences decoding, steps
alternated between the two): CPU ms per step (time.process_time, the minimum of the rounds).

    python benchmarks/bench_block_kernels.py --int8 --decode-steps --rows 1 4 16 --threads 1

`--prompt-rows` times prompt rows of all 30 layers' projections: the bf16 dense product as
worker/model/linear.py calls it beside block copies (tiled_linear in TILE_ROWS-row tiles
where this CPU's bf16 GEMM is not row-independent, else one F.linear, on fp32 activations
cast to bf16 and back) against the int8-activation block kernels (q4_matmul_i8), CPU time
(time.process_time), alternated, the minimum of rounds x repeats.

    python benchmarks/bench_block_kernels.py --prompt-rows --rows 32 128 256 512 --threads 1
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
    parser.add_argument("--int8", action="store_true",
                        help="fp32 against int8 activations on the same blocks")
    parser.add_argument("--accuracy", action="store_true",
                        help="with --int8: the two kernels' outputs on the real model")
    parser.add_argument("--decode-steps", action="store_true",
                        help="with --int8: whole decode steps of the real model")
    parser.add_argument("--prompt-rows", action="store_true",
                        help="bf16 dense (as linear.py) against int8-x blocks, prompt rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels.load(required=True)
    if args.int8 and args.decode_steps:
        int8_decode_steps(args)
        return
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

    if args.prompt_rows:
        prompt_rows_table(args, kernels, layers, gen)
        return
    if args.int8:
        int8_table(args, kernels, [[blocks for _, blocks in layer] for layer in layers],
                   head_q8, gen)
        if args.accuracy:
            int8_accuracy()
        return
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


def int8_table(args, kernels, layers: list[list[torch.Tensor]], head_q8: torch.Tensor,
               gen: torch.Generator) -> None:
    """ms per call, fp32 activations (q4_matmul / q8_matmul) against int8 (the _i8 twins),
    each the minimum over rounds x repeats, the two timed alternately."""
    outs = [out for out, _ in LAYER_SHAPES]
    print(f"threads={args.threads}; ms per call of all 30 layers' projections / of the lm_head "
          f"(min of {args.rounds * args.repeats}); {cpu_kernels.process_class().describe()}")
    layer_bytes = sum(blocks.numel() for layer in layers for blocks in layer)
    print(f"(weights read per call: layers {layer_bytes / 1e6:.1f} MB, lm_head "
          f"{head_q8.numel() / 1e6:.1f} MB; GB/s: those bytes over the int8-x time)")
    print("| rows | layers q4 fp32-x | layers q4 int8-x | speed-up | GB/s | lm_head q8 fp32-x "
          "| lm_head q8 int8-x | speed-up | GB/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        xs = {n: torch.randn(rows, n, generator=gen) for n in (576, 1536)}

        def all_layers(q4, xs=xs):
            for layer in layers:
                for blocks, out in zip(layer, outs, strict=True):
                    q4(xs[blocks.shape[1] * 32], blocks, out)

        x = xs[576]
        cases = {
            "q4": lambda: all_layers(kernels.q4_matmul),
            "q4_i8": lambda: all_layers(kernels.q4_matmul_i8),
            "q8": lambda x=x: kernels.q8_matmul(x, head_q8, VOCAB),
            "q8_i8": lambda x=x: kernels.q8_matmul_i8(x, head_q8, VOCAB),
        }
        best = {k: float("inf") for k in cases}
        for _ in range(args.rounds):
            for name, fn in cases.items():
                best[name] = min(best[name], min_time(fn, args.repeats))
        print(f"| {rows} | {best['q4']:.2f} | {best['q4_i8']:.2f} | "
              f"{best['q4'] / best['q4_i8']:.2f}x | {layer_bytes / best['q4_i8'] / 1e6:.1f} "
              f"| {best['q8']:.2f} | {best['q8_i8']:.2f} | {best['q8'] / best['q8_i8']:.2f}x "
              f"| {head_q8.numel() / best['q8_i8'] / 1e6:.1f} |")


def prompt_rows_table(args, kernels, layers, gen: torch.Generator) -> None:
    """CPU ms per call of all 30 layers' projections, prompt rows: bf16 dense as
    worker/model/linear.py calls it against the int8-activation block kernels."""
    from zeroserve.worker.model.batch_invariance import dense_tile_rows, tiled_linear

    tile = dense_tile_rows(torch.bfloat16, torch.device("cpu"))
    bf16 = [[(dense.to(torch.bfloat16), blocks) for dense, blocks in layer] for layer in layers]
    print(f"threads={args.threads}; CPU ms (process_time) per call of all 30 layers' "
          f"projections, min of {args.rounds * args.repeats}; bf16 tile={tile}; "
          f"{cpu_kernels.process_class().describe()}")
    print("| rows | bf16 dense | int8-x blocks | bf16 / int8 | bf16 ms/row | int8 ms/row |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        xs = {n: torch.randn(rows, n, generator=gen) for n in (576, 1536)}

        def dense_layers(xs=xs):
            for layer in bf16:
                for dense, _ in layer:
                    x = xs[dense.shape[1]].to(torch.bfloat16)
                    out = tiled_linear(x, dense, tile) if tile else F.linear(x, dense)
                    out.float()

        def int8_layers(xs=xs):
            for layer in bf16:
                for dense, blocks in layer:
                    kernels.q4_matmul_i8(xs[dense.shape[1]], blocks, dense.shape[0])

        cases = {"bf16": dense_layers, "int8": int8_layers}
        best = {k: float("inf") for k in cases}
        for _ in range(args.rounds):
            for name, fn in cases.items():
                best[name] = min(best[name], min_time(fn, args.repeats, time.process_time))
        print(f"| {rows} | {best['bf16']:.1f} | {best['int8']:.1f} | "
              f"{best['bf16'] / best['int8']:.2f}x | {best['bf16'] / rows:.3f} "
              f"| {best['int8'] / rows:.3f} |")


def min_time(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = clock()
        fn()
        times.append(clock() - started)
    return min(times) * 1e3


def int8_decode_steps(args) -> None:
    from zeroserve.worker.config import EngineConfig
    from zeroserve.worker.engine import Engine
    from zeroserve.worker.sequence import SamplingParams

    engines = {int8: Engine(EngineConfig(model="default", device="cpu", dtype="float32",
                                         int8_activations=int8, max_num_seqs=64))
               for int8 in (False, True)}
    steps = 8
    print(f"threads={args.threads}; CPU ms per decode step of the default model, fp32 "
          f"(min of {args.rounds} rounds of {steps} steps); "
          f"{cpu_kernels.process_class().describe()}")
    print("| sequences | fp32 activations | int8 activations | speed-up |")
    print("|---:|---:|---:|---:|")
    params = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True)
    for rows in args.rows:
        for int8, engine in engines.items():
            for i in range(rows):
                engine.add_request(f"{rows}-{int8}-{i}", [1, 504, 3000 + 17 * i, 42, 9, 7],
                                   params)
            for _ in range(3):  # the prompts' prefill, then decodes only
                engine.step()
        best = {False: float("inf"), True: float("inf")}
        for _ in range(args.rounds):
            for int8, engine in engines.items():
                started = time.process_time()
                for _ in range(steps):
                    engine.step()
                best[int8] = min(best[int8], (time.process_time() - started) / steps * 1e3)
        for int8, engine in engines.items():
            for i in range(rows):
                engine.abort(f"{rows}-{int8}-{i}")
            while engine.has_unfinished():
                engine.step()
        print(f"| {rows} | {best[False]:.2f} | {best[True]:.2f} | "
              f"{best[False] / best[True]:.2f}x |")


def int8_accuracy() -> None:
    """The default model (fp32, its file's Q4/Q8_0 blocks) over a prompt; every projection's
    inputs as the layers saw them, through both kernels: the largest |difference| and the
    largest |output| per kind of projection."""
    from zeroserve.worker.model import linear
    from zeroserve.worker.model.loader import load_model

    model, _ = load_model("default", torch.device("cpu"), torch.float32)
    seen: dict[int, list[torch.Tensor]] = {}
    call = linear.Linear.__call__

    def recording(self, x, *rest, **kw):
        seen.setdefault(id(self), []).append(x.clone())
        return call(self, x, *rest, **kw)

    from zeroserve.gateway.text.tokenizer import load_tokenizer

    text = ("In 1905 Albert Einstein published four papers that changed physics: on the "
            "photoelectric effect, on Brownian motion, on special relativity, and on the "
            "equivalence of mass and energy. Each of them would have been enough to make "
            "his name; together they opened the century's physics.")
    ids = load_tokenizer("default").encode(text)[:60]
    linear.Linear.__call__ = recording
    try:
        model.forward_unpaged(ids)  # prompt rows below 64: all through the blocks
    finally:
        linear.Linear.__call__ = call
    kinds = {"qkv": [], "o_proj": [], "gate_up": [], "down": [], "lm_head": []}
    for layer in model.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            kinds[name].append(getattr(layer, name))
    kinds["lm_head"].append(model.lm_head)
    print(f"\n{len(ids)} tokens of English text through every layer")
    print("| projection | max abs diff int8-x vs fp32-x | max abs output | ratio "
          "| relative RMS error |")
    print("|---|---:|---:|---:|---:|")
    for name, lins in kinds.items():
        diff = out_max = 0.0
        squares = [0.0, 0.0]  # sum of squared differences, of squared outputs
        for lin in lins:
            packed = lin.packed
            i8 = (cpu_kernels.load().q4_matmul_i8 if packed.data.shape[2] in (320, 384)
                  else cpu_kernels.load().q8_matmul_i8)
            for x in seen.get(id(lin), []):
                ref = packed.mm(x).double()
                delta = i8(x, packed.data, packed.out_features).double() - ref
                diff = max(diff, delta.abs().max().item())
                out_max = max(out_max, ref.abs().max().item())
                squares[0] += delta.square().sum().item()
                squares[1] += ref.square().sum().item()
        print(f"| {name} | {diff:.4g} | {out_max:.4g} | {diff / out_max:.2e} "
              f"| {(squares[0] / squares[1]) ** 0.5:.2e} |")


if __name__ == "__main__":
    main()
