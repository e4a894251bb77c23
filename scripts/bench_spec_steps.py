"""n-gram speculation at one client, counted instead of timed: the steps and rows it takes.

On a shared machine a timed on/off run swings 2-5x from one repeat to the next (other
processes take the cores). Greedy decoding makes the work itself deterministic: this runs the
benchmark prompts through an in-process Engine of the default model, one request at a time,
with speculation off and with the given configs, and reports for each the forward steps,
the rows they computed, the accepted drafts per position and a modelled speed: output tokens
per plain-step-equivalent, where a step of r rows costs STEP_COST[r] one-row steps (measured
on this machine's 2 cores with the runner alone, docs/benchmarks.md "Adaptive n-gram
speculation"). Wall time is reported too: the best and median of `--repeats` alternated
rounds (the best is the least disturbed by other processes).

    python scripts/bench_spec_steps.py --workload grounded --output-len 128
    python scripts/bench_spec_steps.py --workload chat --num-prompts 3 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.bench_speculative import chat_messages, grounded_messages  # noqa: E402
from zeroserve.worker.config import EngineConfig  # noqa: E402
from zeroserve.worker.engine import Engine  # noqa: E402
from zeroserve.worker.sequence import SamplingParams  # noqa: E402
from zeroserve.worker.speculative import SpeculativeConfig  # noqa: E402

# A step of r rows (one sequence: its token and r - 1 drafts) in one-row steps: the
# runner's median per-step time over a 300-token context, fp32, 2 threads.
STEP_COST = {1: 1.0, 2: 1.17, 3: 1.32, 4: 1.46, 5: 1.59, 6: 1.76, 7: 1.94, 8: 2.08, 9: 2.65,
             13: 3.33}


def step_cost(rows: int) -> float:
    if rows in STEP_COST:
        return STEP_COST[rows]
    below = max(r for r in STEP_COST if r < rows)
    above = min((r for r in STEP_COST if r > rows), default=None)
    if above is None:
        return STEP_COST[below] * rows / below
    share = (rows - below) / (above - below)
    return STEP_COST[below] + share * (STEP_COST[above] - STEP_COST[below])


def encode(messages: list[list[dict]]) -> list[list[int]]:
    from transformers import AutoTokenizer

    from zeroserve.common.model_files import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for m in messages]


def run(engine: Engine, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    num_steps, cost, rows, tokens = 0, 0.0, 0, []
    before = engine.stats().spec_decode
    base = (before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens,
            list(before.num_accepted_tokens_per_pos))
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):  # one client: one request at a time
        engine.add_request(f"r{i}", prompt, params)
        out: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                out += o.new_token_ids
            n = engine.last_step.num_tokens
            if n:
                num_steps += 1
                rows += n
                # A prefill costs the same with and without drafts: one plain step here.
                cost += step_cost(n) if n <= max(STEP_COST) else 1.0
        tokens.append(out)
    seconds = time.perf_counter() - started
    stats = engine.stats().spec_decode
    num_drafts = stats.num_drafts - base[0]
    per_pos = [n - (base[3][j] if j < len(base[3]) else 0)
               for j, n in enumerate(stats.num_accepted_tokens_per_pos)]
    num_tokens = sum(len(t) for t in tokens)
    return {"num_tokens": num_tokens, "num_steps": num_steps, "num_rows": rows,
            "modelled_cost": round(cost, 1), "tokens_per_cost": num_tokens / cost,
            "num_drafts": num_drafts, "num_draft_tokens": stats.num_draft_tokens - base[1],
            "num_accepted_tokens": stats.num_accepted_tokens - base[2],
            "accepted_per_position": [round(n / num_drafts, 2) for n in per_pos]
            if num_drafts else [],
            "wall_tok_s": num_tokens / seconds, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=["grounded", "chat"], default="grounded")
    ap.add_argument("--num-prompts", type=int, default=3, help="chat only (grounded: 3)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--config", action="append", default=None,
                    help="a --speculative-config JSON to compare with off (repeatable; "
                         "default: the default config)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed rounds per config, alternated (the counts are the same)")
    ap.add_argument("--result-json", type=Path, default=None)
    args = ap.parse_args(argv)
    messages = grounded_messages() if args.workload == "grounded" else \
        chat_messages(args.num_prompts)
    prompts = encode(messages)
    configs = {"off": None}
    for text in args.config or [SpeculativeConfig().to_json()]:
        configs[text] = SpeculativeConfig.from_json(text)
    engines = {name: Engine(EngineConfig(device="cpu", num_kv_blocks=256, max_model_len=2048,
                                         speculative_config=spec))
               for name, spec in configs.items()}
    for engine in engines.values():
        run(engine, prompts[:1], 8)  # warm-up
    results: dict[str, dict] = {}
    walls: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for repeat in range(args.repeats):  # alternated: a load change hits every config
        for name in names if repeat % 2 == 0 else names[::-1]:
            r = run(engines[name], prompts, args.output_len)
            results.setdefault(name, r)
            walls[name].append(r["wall_tok_s"])
    off = results["off"]
    for name, r in results.items():
        same = r["tokens"] == off["tokens"]
        r["wall_tok_s"] = walls[name]
        print(f"{name}: {r['num_tokens']} tokens in {r['num_steps']} steps, {r['num_rows']} "
              f"rows, modelled {r['modelled_cost']} plain steps -> "
              f"{r['tokens_per_cost'] / off['tokens_per_cost']:.2f}x off; drafts "
              f"{r['num_drafts']}, accepted {r['num_accepted_tokens']} of "
              f"{r['num_draft_tokens']}, per position {r['accepted_per_position']}; "
              f"wall tok/s best {max(walls[name]):.1f} ({max(walls[name]) / max(walls['off']):.2f}x"
              f" off's best), median {statistics.median(walls[name]):.1f}; "
              f"same tokens as off: {same}", flush=True)
    if args.result_json is not None:
        args.result_json.write_text(json.dumps(
            {k: {f: v for f, v in r.items() if f != "tokens"} for k, r in results.items()},
            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
