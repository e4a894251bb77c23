"""The worker's per-step cost at N decoding sequences, in-process and with no forward.

The relay benchmark's worker (`zeroserve worker --backend fake --fake-forward-ms 20`) takes
20 ms of sleep plus whatever the engine loop costs around it at every step; that cost comes
straight off the tokens/s the gateway can deliver. This measures it without sockets or
sleeps: N requests decoding in an Engine over a FakeRunner (no plan checks, as the worker
process runs it), and per step the engine's step() and the building + encoding of the TOKENS
message the worker would send (worker/process.py's _to_wire, common/protocol.py's encode).

    python scripts/bench_worker_step.py --seqs 1000 --steps 60
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompt-tokens", type=int, default=5)
    args = ap.parse_args()

    from common.protocol import Tokens, encode
    from worker.config import EngineConfig
    from worker.engine import Engine
    from worker.fake_runner import FakeRunner
    from worker.process import _to_wire
    from worker.sequence import SamplingParams

    config = EngineConfig(model="fake", max_num_seqs=args.seqs,
                          max_num_batched_tokens=max(args.seqs * args.prompt_tokens, 512),
                          num_kv_blocks=args.seqs * ((args.prompt_tokens + args.steps) // 16 + 3))
    engine = Engine(config, runner=FakeRunner(config, check_plans=False))
    params = SamplingParams(max_tokens=args.steps + 10, ignore_eos=True)
    for i in range(args.seqs):
        engine.add_request(f"req-{i:032x}", [1000 + i] * args.prompt_tokens, params)
    engine.step()  # the prefill step
    gc.collect()
    step_s, emit_s = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        encode(Tokens("w", step, [_to_wire(o) for o in outputs]))
        t2 = time.perf_counter()
        step_s.append(t1 - t0)
        emit_s.append(t2 - t1)
    result = {
        "seqs": args.seqs, "steps": args.steps,
        "engine_step_ms": round(1000 * statistics.median(step_s), 2),
        "emit_ms": round(1000 * statistics.median(emit_s), 2),
        "total_us_per_seq": round(1e6 * (statistics.median(step_s)
                                         + statistics.median(emit_s)) / args.seqs, 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
