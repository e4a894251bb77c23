"""What prefill rows in fixed tiles cost (worker/model/batch_invariance.py), side by side.

On a CPU whose dense bf16 kernel is not row-independent, the model runs prefill rows in tiles
of TILE_ROWS for batch independence. This loads the default model once, then alternates two
engines over the same weights, one with the tiles and one without, on a prefill-heavy batch
(--prompts prompts of --prompt-tokens tokens, --max-tokens each) and reports the median
wall time of each and their ratio:

    python scripts/bench_dense_tiles.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zeroserve.worker.config import EngineConfig
from zeroserve.worker.engine import Engine
from zeroserve.worker.model.batch_invariance import dense_tile_rows
from zeroserve.worker.sequence import SamplingParams


def set_tiles(engine: Engine, tile_rows: int | None) -> None:
    model = engine.runner.model
    for layer in model.layers:
        for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            linear.tile_rows = tile_rows
    model.lm_head.tile_rows = tile_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # The invariant mode: the one with tiles (the default mode has none to switch).
    engine = Engine(EngineConfig(device="cpu", dtype="bfloat16", enable_prefix_caching=False,
                                 max_num_seqs=64, max_num_batched_tokens=512,
                                 batch_invariant=True))
    tiles = dense_tile_rows(torch.bfloat16, torch.device("cpu"))
    print(f"this CPU's tile size: {tiles} (None: the dense kernel is row-independent here)")
    prompts = [[(7 * i + 13 * j) % 30000 + 100 for j in range(args.prompt_tokens)]
               for i in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    times: dict[str, list[float]] = {"tiles": [], "one call": []}
    for _ in range(args.repeats):
        for name, tile_rows in (("tiles", tiles or 128), ("one call", None)):
            set_tiles(engine, tile_rows)
            started = time.perf_counter()
            engine.generate(prompts, params)
            times[name].append(time.perf_counter() - started)
    tiled, plain = statistics.median(times["tiles"]), statistics.median(times["one call"])
    print(f"{args.prompts} prompts x {args.prompt_tokens} tokens, {args.max_tokens} out, "
          f"{args.repeats} alternated repeats: tiles {tiled:.2f} s, one call {plain:.2f} s "
          f"(median), ratio {tiled / plain:.2f}x")


if __name__ == "__main__":
    main()
