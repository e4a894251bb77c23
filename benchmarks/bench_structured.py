"""What a JSON schema costs: the serving benchmark (benchmarks/bench_serving.py: ShareGPT chat
prompts, 16 concurrent streams, fixed output length) with and without `response_format`
json_schema, run alternately and repeated on one server, so both see the same machine.

With `ignore_eos` every request produces the same number of tokens either way; a constrained
request whose JSON is complete before that has only EOS left to emit, so the schema below is
one a reply keeps filling (an open list of objects with free-text fields), and the script
reports how many replies were still inside the grammar at the end (their JSON incomplete).

    python benchmarks/bench_structured.py --base-url http://127.0.0.1:8000 --concurrency 16 \\
        --num-prompts 32 --output-len 64 --repeats 3 --result-json .bench/structured.json

A shared machine's load swings move tokens/s far more than a few percent, so `--in-process`
measures what the grammar adds where it is added: an Engine (no HTTP) decoding 16 sequences
with and without the schema, alternated, and per full decode step (16 rows) the median time
of the forward and of input preparation + sampling (where the masks are built and applied).

    python benchmarks/bench_structured.py --in-process --repeats 3 --output-len 48
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import bench_serving  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string"},
        "points": {"type": "array", "items": {
            "type": "object",
            "properties": {"title": {"type": "string"}, "detail": {"type": "string"},
                           "importance": {"type": "integer", "minimum": 1, "maximum": 5}},
            "required": ["title", "detail", "importance"],
            "additionalProperties": False}},
    },
    "required": ["topic", "points"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "notes", "schema": SCHEMA, "strict": True}}


def run_variant(cfg: bench_serving.BenchConfig, samples, with_schema: bool) -> dict:
    original = bench_serving.build_body
    texts: list[str] = []

    def build_body(*args, **kwargs) -> dict:
        body = original(*args, **kwargs)
        if with_schema:
            body["response_format"] = RESPONSE_FORMAT
        return body

    original_take = bench_serving._take_choice

    def take_choice(result, choice, body):
        delta = choice.get("delta") or {}
        if delta.get("content"):
            texts.append(f"{result.index}\0{delta['content']}")
        return original_take(result, choice, body)

    bench_serving.build_body = build_body
    bench_serving._take_choice = take_choice
    try:
        summary = bench_serving.run(cfg, samples)
    finally:
        bench_serving.build_body = original
        bench_serving._take_choice = original_take
    if with_schema:
        replies: dict[str, str] = {}
        for item in texts:
            index, text = item.split("\0", 1)
            replies[index] = replies.get(index, "") + text
        complete = 0
        for text in replies.values():
            try:
                json.loads(text)
                complete += 1
            except ValueError:
                pass
        summary["json_complete_before_limit"] = complete
        summary["num_replies_seen"] = len(replies)
    return summary


def in_process(args: argparse.Namespace) -> dict:
    import torch

    from zeroserve.gateway.text.chat_template import ChatTemplate
    from zeroserve.gateway.text.tokenizer import load_tokenizer
    from zeroserve.worker.config import EngineConfig
    from zeroserve.worker.engine import Engine
    from zeroserve.worker.grammar import GrammarSpec
    from zeroserve.worker.sequence import SamplingParams

    torch.set_num_threads(2)
    tokenizer = load_tokenizer("default")
    template = ChatTemplate.from_tokenizer(tokenizer)
    engine = Engine(EngineConfig(device="cpu", max_num_seqs=args.concurrency))
    topics = ["the history of Rome", "photosynthesis", "Python lists", "TCP", "jazz",
              "volcanoes", "the French revolution", "black holes"]
    prompts = [tokenizer.encode(template.render([{"role": "user", "content":
               f"Write notes on {topics[i % len(topics)]} ({i})."}], True),
               add_special_tokens=False) for i in range(args.concurrency)]
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    count = iter(range(10**9))

    def run(with_schema: bool) -> dict:
        for prompt in prompts:
            engine.add_request(f"r{next(count)}", prompt, SamplingParams(
                max_tokens=args.output_len, temperature=0.0, ignore_eos=True),
                grammar=spec if with_schema else None)
        forward, rest, start, cpu = [], [], time.perf_counter(), time.process_time()
        grammar_ms.update(masks=0.0, apply=0.0)
        num_steps = 0
        num_tokens = 0
        while engine.has_unfinished():
            num_tokens += sum(len(o.new_token_ids) for o in engine.step())
            num_steps += 1
            step = engine.stats().last_step
            if step.num_seqs == len(prompts) == step.num_tokens:  # a full decode step
                forward.append(step.forward_s * 1000)
                rest.append((step.prepare_s + step.sample_s) * 1000)
        return {"tokens_per_s": num_tokens / (time.perf_counter() - start),
                # CPU time of all this process's threads (torch's and the grammar's) per
                # token: what the work costs, far less moved by other processes than time.
                "cpu_ms_per_token": (time.process_time() - cpu) * 1000 / num_tokens,
                "forward_ms": statistics.median(forward),
                "grammar_masks_ms_per_step": grammar_ms["masks"] / num_steps,
                "grammar_apply_ms_per_step": grammar_ms["apply"] / num_steps,
                "prepare_sample_ms": statistics.median(rest)}

    # The grammar's own work, timed where it happens: the masks (on the helper thread,
    # overlapping the forward) and their application (after it, on the engine thread).
    from zeroserve.worker.sampler import GrammarMasks

    grammar_ms = {"masks": 0.0, "apply": 0.0}

    def timed(function, key):
        def wrapper(self, *a):
            t = time.perf_counter()
            try:
                return function(self, *a)
            finally:
                grammar_ms[key] += (time.perf_counter() - t) * 1000
        return wrapper

    GrammarMasks._compute = timed(GrammarMasks._compute, "masks")
    GrammarMasks.apply = timed(GrammarMasks.apply, "apply")

    run(False)  # warm-up
    runs: dict[str, list[dict]] = {"plain": [], "json_schema": []}
    for r in range(args.repeats):
        for with_schema in ([False, True] if r % 2 == 0 else [True, False]):
            name = "json_schema" if with_schema else "plain"
            runs[name].append(run(with_schema))
            print(f"repeat {r + 1} {name:12s} " + "  ".join(
                f"{k} {v:.2f}" for k, v in runs[name][-1].items()), flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()}
    added = med["json_schema"]["prepare_sample_ms"] - med["plain"]["prepare_sample_ms"]
    step = med["plain"]["forward_ms"] + med["plain"]["prepare_sample_ms"]
    return {"mode": "in-process", "config": {k: str(v) for k, v in vars(args).items()},
            "medians": med, "added_ms_per_step": added,
            "added_share_of_step": added / step,
            "cpu_per_token_ratio": (med["json_schema"]["cpu_ms_per_token"]
                                    / med["plain"]["cpu_ms_per_token"]), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--result-json", type=Path, default=None)
    ap.add_argument("--in-process", action="store_true",
                    help="time an Engine's steps with and without the schema (no server)")
    args = ap.parse_args(argv)
    if args.in_process:
        result = in_process(args)
        print(json.dumps({k: result[k] for k in ("medians", "added_ms_per_step",
                                                 "added_share_of_step", "cpu_per_token_ratio")},
                         indent=1))
        if args.result_json is not None:
            args.result_json.parent.mkdir(parents=True, exist_ok=True)
            args.result_json.write_text(json.dumps(result, indent=1))
        return 0
    cfg = bench_serving.BenchConfig(
        base_url=args.base_url, concurrency=args.concurrency, num_prompts=args.num_prompts,
        output_len=args.output_len, max_prompt_tokens=args.max_prompt_tokens,
        show_progress=False)
    samples = None  # bench_serving loads (and caches) the ShareGPT mix itself
    runs: dict[str, list[dict]] = {"plain": [], "json_schema": []}
    for r in range(args.repeats):
        order = [False, True] if r % 2 == 0 else [True, False]  # alternate who goes first
        for with_schema in order:
            name = "json_schema" if with_schema else "plain"
            summary = run_variant(replace(cfg, label=name), samples, with_schema)
            runs[name].append(summary)
            print(f"repeat {r + 1} {name:12s} {summary['output_throughput']:.1f} tok/s "
                  f"failed {summary['failed']}"
                  + (f", JSON complete before the limit in "
                     f"{summary['json_complete_before_limit']}/{summary['num_replies_seen']}"
                     if with_schema else ""), flush=True)
    med = {k: statistics.median(s["output_throughput"] for s in v) for k, v in runs.items()}
    result = {
        "config": vars(args) | {"result_json": str(args.result_json)},
        "median_output_throughput": med,
        "ratio_json_schema_to_plain": med["json_schema"] / med["plain"],
        "runs": {k: [{"output_throughput": s["output_throughput"],
                      "failed": s["failed"],
                      "ttft_p50_ms": s.get("ttft_ms", {}).get("p50"),
                      "itl_p50_ms": s.get("itl_ms", {}).get("p50"),
                      **({"json_complete_before_limit": s["json_complete_before_limit"]}
                         if "json_complete_before_limit" in s else {})}
                     for s in v] for k, v in runs.items()},
    }
    print(json.dumps({k: result[k] for k in ("median_output_throughput",
                                             "ratio_json_schema_to_plain")}, indent=1))
    if args.result_json is not None:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
