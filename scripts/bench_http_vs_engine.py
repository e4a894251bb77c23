"""What the gateway and ZeroMQ cost: one workload in-process vs. through HTTP, side by side.

The same chat prompts (ShareGPT, chat template applied exactly as the gateway applies it),
the same fixed output length (ignore_eos) and the same sequence cap run twice, alternated:
  1. in-process: `Engine.generate` with every prompt queued at once, max_num_seqs = N;
  2. HTTP: `zeroserve serve --max-num-seqs N` driven by scripts/bench_serving.py with N
     concurrent streaming clients (closed loop), the same prompts.
Output tokens/s of each, and the ratio, are printed as a markdown table.

    python scripts/bench_http_vs_engine.py --num-prompts 64 --concurrency 32 --output-len 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from bench_data import load_chat_samples  # noqa: E402
from bench_serving import BenchConfig, run  # noqa: E402

from zeroserve.cli.harness import ServerError, start_server  # noqa: E402


def in_process(prompts: list[list[int]], args: argparse.Namespace) -> float:
    import torch

    from zeroserve.worker.config import EngineConfig
    from zeroserve.worker.engine import Engine
    from zeroserve.worker.sequence import SamplingParams

    torch.set_num_threads(args.threads)
    config = EngineConfig(max_num_seqs=args.concurrency, num_threads=args.threads)
    engine = Engine(config)
    engine.generate(prompts[:2], SamplingParams(max_tokens=16, ignore_eos=True))  # warm-up
    engine = Engine(config, runner=engine.runner)  # fresh prefix cache, warm kernels
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    return sum(len(o) for o in outputs) / wall


def over_http(samples, args: argparse.Namespace) -> float:
    try:
        server = start_server(args=("--max-num-seqs", str(args.concurrency), "--num-threads",
                                    str(args.threads)), timeout_s=300,
                              log_path=REPO_ROOT / ".bench" / "logs" / "http_vs_engine.log")
    except ServerError as e:
        raise SystemExit(f"zeroserve did not start: {e.why}") from None
    try:
        cfg = BenchConfig(base_url=server.url, num_prompts=len(samples),
                          concurrency=args.concurrency, output_len=args.output_len,
                          num_warmup=2, show_progress=False)
        summary = run(cfg, samples)
        if summary.get("failed") or summary.get("token_mismatches"):
            print(f"warning: HTTP run had failures or mismatches: {summary}", file=sys.stderr)
        return summary["output_throughput"]
    finally:
        server.stop(timeout_s=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from zeroserve.gateway.text.chat_template import ChatTemplate
    from zeroserve.gateway.text.tokenizer import load_tokenizer

    samples = load_chat_samples(args.num_prompts, max_prompt_tokens=args.max_prompt_tokens)
    tokenizer = load_tokenizer("default")
    template = ChatTemplate.from_tokenizer(tokenizer)
    prompts = [tokenizer.encode(template.render(s.messages, True), add_special_tokens=False)
               for s in samples]

    engine_tps: list[float] = []
    http_tps: list[float] = []
    for repeat in range(args.repeats):
        order = ("engine", "http") if repeat % 2 == 0 else ("http", "engine")
        for what in order:
            if what == "engine":
                engine_tps.append(in_process(prompts, args))
            else:
                http_tps.append(over_http(samples, args))
            print(f"repeat {repeat + 1} {what}: "
                  f"{(engine_tps if what == 'engine' else http_tps)[-1]:.1f} tok/s", flush=True)

    e, h = statistics.median(engine_tps), statistics.median(http_tps)
    print(f"\n| path | output tok/s (median of {args.repeats}) |\n| --- | ---: |")
    print(f"| in-process Engine.generate | {e:.1f} |\n| HTTP + ZeroMQ (zeroserve serve) | {h:.1f} |")
    print(f"\nHTTP / in-process: {h / e:.3f} ({(1 - h / e) * 100:+.1f}% cost)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
