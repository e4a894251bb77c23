"""Offline engine throughput: continuous vs static vs dynamic batching vs HF `generate`.

One fixed mixed workload, every system in the same run on the same model:

- prompts: first user turns from ShareGPT (scripts/bench_data.py), chat template applied;
- output lengths: each prompt's reference reply length (the dataset's own distribution)
  times --output-scale, clipped to [--min-output, --max-output]; EOS is ignored so every
  system generates exactly those tokens;
- zeroserve's engine in CONTINUOUS, STATIC and DYNAMIC mode (one ModelRunner shared by all,
  so the model loads once), and Hugging Face transformers `generate` on the same GGUF weights
  in static batches of --max-num-seqs (left padded, run to the batch's longest output),
  in fp32 and/or bf16 (--hf-dtypes).

Output tokens/s counts only the tokens each request asked for (a static batch's extra tokens
for early finishers are waste). "Rows computed" is the noise-free side of the same story:
token rows pushed through the model (prompts, outputs, padding rows, padded prompts). For continuous mode it also reports where the time of steps
with --max-num-seqs sequences in the batch went: the share outside the model forward is
1 - forward / step wall time (schedule, input preparation, sampling and state update).

    python scripts/bench_engine.py                      # defaults: 128 prompts, 32 seqs
    python scripts/bench_engine.py --systems continuous --num-prompts 96   # overhead only

Prints a markdown table (and --json PATH writes the raw numbers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.bench_data import load_chat_samples, load_tokenizer  # noqa: E402
from worker.config import BatchingMode, EngineConfig  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.outputs import StepTiming  # noqa: E402
from worker.sequence import SamplingParams  # noqa: E402

ENGINE_MODES = {mode.value: mode for mode in BatchingMode}


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    system: str
    wall_s: float
    num_output_tokens: int
    num_steps: int = 0
    num_rows: int = 0  # token rows pushed through the model (prompt + generated + padding)
    notes: str = ""
    full_steps: list[tuple[float, StepTiming]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s


def build_workload(args: argparse.Namespace) -> Workload:
    samples = load_chat_samples(
        args.num_prompts, seed=args.seed, max_prompt_tokens=args.max_prompt_tokens
    )
    tokenizer = load_tokenizer()
    prompts, output_lens = [], []
    for sample in samples:
        ids = tokenizer.apply_chat_template(sample.messages, add_generation_prompt=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        prompts.append(list(ids))
        scaled = round(sample.num_reference_output_tokens * args.output_scale)
        output_lens.append(max(args.min_output, min(args.max_output, scaled)))
    return Workload(prompts, output_lens)


def engine_config(args: argparse.Namespace, mode: BatchingMode) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        batching_mode=mode,
        batch_wait_ms=args.batch_wait_ms,
        num_threads=args.threads,
    )


def run_engine(
    engine: Engine, workload: Workload, name: str, max_num_seqs: int, progress_s: float = 60.0
) -> Result:
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens
    ]
    for i, (prompt, p) in enumerate(zip(workload.prompts, params, strict=True)):
        engine.add_request(f"{name}-{i}", prompt, p)
    num_tokens = num_rows = 0
    full_steps: list[tuple[float, StepTiming]] = []
    started = last_report = time.perf_counter()
    while engine.has_unfinished():
        step_started = time.perf_counter()
        outputs = engine.step()
        step_s = time.perf_counter() - step_started
        timing = engine.stats().last_step
        num_rows += timing.num_tokens
        if timing.num_seqs == max_num_seqs:
            full_steps.append((step_s, timing))
        elif timing.num_seqs == 0:
            time.sleep(0.0005)  # dynamic mode gathering: nothing to run yet
        num_tokens += sum(len(o.new_token_ids) for o in outputs)
        if progress_s and time.perf_counter() - last_report >= progress_s:
            last_report = time.perf_counter()
            print(f"  ... {name}: {num_tokens}/{workload.num_output_tokens} tokens", flush=True)
    wall_s = time.perf_counter() - started
    assert num_tokens == workload.num_output_tokens, (num_tokens, workload.num_output_tokens)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return Result(name, wall_s, num_tokens, stats.num_steps, num_rows, "", full_steps)


def load_hf_model(args: argparse.Namespace):
    import torch
    from transformers import AutoModelForCausalLM

    from common.model_files import default_model_path

    if args.model == "default":
        path = default_model_path()
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    elif args.model.endswith(".gguf"):
        path = Path(args.model)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    return model.eval()


def run_hf(model, workload: Workload, dtype_name: str, batch_size: int, pad_id: int) -> Result:
    import torch

    model = model.to(getattr(torch, dtype_name))
    started = time.perf_counter()
    num_generated = num_rows = 0
    for start in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[start : start + batch_size]
        lens = workload.output_lens[start : start + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),  # no early EOS: same tokens as the engine runs
                do_sample=False,
                pad_token_id=pad_id,
            )
        num_generated += (out.shape[1] - width) * len(prompts)
        num_rows += out.shape[1] * len(prompts)  # padded prompts, then one row per step each
    wall_s = time.perf_counter() - started
    waste = 1 - workload.num_output_tokens / num_generated
    return Result(
        f"transformers generate ({dtype_name}, static batches of {batch_size})",
        wall_s,
        workload.num_output_tokens,
        num_rows=num_rows,
        notes=f"{waste:.0%} of generated tokens past a request's length",
    )


def overhead_summary(result: Result) -> str:
    steps = result.full_steps
    if not steps:
        return "no step ran with a full batch"
    wall = sum(s for s, _ in steps)
    parts = {
        "schedule": sum(t.schedule_s for _, t in steps),
        "prepare": sum(t.prepare_s for _, t in steps),
        "forward": sum(t.forward_s for _, t in steps),
        "sample": sum(t.sample_s for _, t in steps),
        "update+outputs": sum(t.update_s for _, t in steps),
    }
    outside = 1 - parts["forward"] / wall
    decode_only = [(s, t) for s, t in steps if t.num_tokens == t.num_seqs]
    text = (
        f"{len(steps)} steps with a full batch, median step {statistics.median(s for s, _ in steps) * 1e3:.1f} ms; "
        f"time outside the model forward: **{outside:.1%}** ("
        + ", ".join(f"{k} {v / wall:.1%}" for k, v in parts.items())
        + f", untimed {1 - sum(parts.values()) / wall:.1%})"
    )
    if decode_only:
        d_wall = sum(s for s, _ in decode_only)
        d_fwd = sum(t.forward_s for _, t in decode_only)
        text += (
            f"; pure-decode steps ({len(decode_only)}): {1 - d_fwd / d_wall:.1%} outside forward"
        )
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto", help="engine dtype (auto: bf16 on CPU)")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--output-scale", type=float, default=0.25)
    ap.add_argument("--min-output", type=int, default=1)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--batch-wait-ms", type=float, default=50.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--systems",
        default="continuous,static,dynamic,hf",
        help="comma list of continuous, static, dynamic, hf",
    )
    ap.add_argument("--hf-dtypes", default="bfloat16,float32")
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    ap.add_argument(
        "--fake-forward-ms",
        type=float,
        default=None,
        help="run the engine modes on FakeRunner with this forward time (checks the script)",
    )
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    workload = build_workload(args)
    prompt_lens = sorted(len(p) for p in workload.prompts)
    out_lens = sorted(workload.output_lens)
    print(
        f"workload: {len(workload.prompts)} prompts, prompt tokens min/median/max "
        f"{prompt_lens[0]}/{prompt_lens[len(prompt_lens) // 2]}/{prompt_lens[-1]}, output tokens "
        f"min/median/max {out_lens[0]}/{out_lens[len(out_lens) // 2]}/{out_lens[-1]} "
        f"(total {workload.num_output_tokens})",
        flush=True,
    )

    results: list[Result] = []
    runner = None
    warmed_up = False
    for system in systems:
        if system in ENGINE_MODES:
            mode = ENGINE_MODES[system]
            config = engine_config(args, mode)
            if runner is None and args.fake_forward_ms is not None:
                from worker.fake_runner import FakeRunner

                runner = FakeRunner(
                    config, forward_time_s=args.fake_forward_ms / 1e3, check_plans=False
                )
            elif runner is None:
                from worker.model_runner import ModelRunner

                runner = ModelRunner(config)
            if not warmed_up:
                # Whichever mode ran first used to be several times slower: the CPU kernels
                # build per-shape state on first use. Push every prompt through once (short
                # outputs) on a throwaway engine, so no mode measures that and no mode finds
                # the prompts in its prefix cache.
                Engine(config, runner=runner).generate(
                    workload.prompts, SamplingParams(max_tokens=4, ignore_eos=True)
                )
                warmed_up = True
            engine = Engine(config, runner=runner)
            name = f"zeroserve {system} ({runner.info.dtype}, max_num_seqs {args.max_num_seqs})"
            result = run_engine(engine, workload, name, args.max_num_seqs)
            result.notes = f"{result.num_steps} steps, {engine.stats().num_preemptions} preemptions"
        elif system == "hf":
            model = load_hf_model(args)
            tokenizer = load_tokenizer()
            pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            for dtype_name in [d.strip() for d in args.hf_dtypes.split(",") if d.strip()]:
                result = run_hf(model, workload, dtype_name, args.max_num_seqs, pad_id)
                results.append(result)
                print(f"{result.system}: {result.tokens_per_s:.1f} tok/s", flush=True)
            del model
            continue
        else:
            raise SystemExit(f"unknown system {system!r}")
        results.append(result)
        print(f"{result.system}: {result.tokens_per_s:.1f} tok/s", flush=True)

    print()
    base = {r.system.split(" (")[0]: r.tokens_per_s for r in results}
    print("| system | output tok/s | wall s | vs static | rows computed | notes |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    static = base.get("zeroserve static")
    for r in results:
        ratio = f"{r.tokens_per_s / static:.2f}x" if static else "n/a"
        print(
            f"| {r.system} | {r.tokens_per_s:.1f} | {r.wall_s:.1f} | {ratio} | {r.num_rows} "
            f"| {r.notes} |"
        )
    continuous = next((r for r in results if r.system.startswith("zeroserve continuous")), None)
    if continuous is not None:
        print()
        print(
            f"Continuous, steps with {args.max_num_seqs} sequences: {overhead_summary(continuous)}"
        )
        hf = [r for r in results if r.system.startswith("transformers")]
        if hf:
            best = max(hf, key=lambda r: r.tokens_per_s)
            print(
                f"Continuous vs best transformers ({best.system}): {continuous.tokens_per_s / best.tokens_per_s:.2f}x"
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    {
                        "system": r.system,
                        "tokens_per_s": r.tokens_per_s,
                        "wall_s": r.wall_s,
                        "num_output_tokens": r.num_output_tokens,
                        "num_rows": r.num_rows,
                        "notes": r.notes,
                    }
                    for r in results
                ],
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
