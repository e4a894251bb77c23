"""Offline engine throughput: continuous vs static vs dynamic batching vs HF `generate`.

One fixed mixed workload, every system in the same run on the same model:

- prompts: first user turns from ShareGPT (benchmarks/bench_data.py), chat template applied;
- output lengths: each prompt's reference reply length (the dataset's own distribution)
  times --output-scale, clipped to [--min-output, --max-output]; EOS is ignored so every
  system generates exactly those tokens;
- zeroserve's engine in CONTINUOUS, STATIC and DYNAMIC mode (one ModelRunner shared by all,
  so the model loads once), and Hugging Face transformers `generate` on the same GGUF weights
  in static batches of --max-num-seqs (left padded, run to the batch's longest output),
  in fp32 and/or bf16 (--hf-dtypes).

Every system is warmed the same way before it is measured (every prompt pushed through once
with 4 output tokens: zeroserve on a throwaway engine, transformers batch by batch), and the
whole set runs --repeats times (default 5) in a rotating order; the table gives each
system's median tokens/s with the min-max over repeats, and ratios taken inside each repeat.

Output tokens/s counts only the tokens each request asked for (a static batch's extra tokens
for early finishers are waste). "Rows computed" is the noise-free side of the same story:
token rows pushed through the model (prompts, outputs, padding rows, padded prompts). For continuous mode it also reports where the time of steps
with --max-num-seqs sequences in the batch went: the share outside the model forward is
1 - forward / step wall time (schedule, input preparation, sampling and state update).

    python benchmarks/bench_engine.py                      # defaults: 128 prompts, 32 seqs, 5 repeats
    python benchmarks/bench_engine.py --systems continuous --num-prompts 96   # overhead only

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

from benchmarks.bench_data import load_chat_samples, load_tokenizer  # noqa: E402
from zeroserve.worker.config import BatchingMode, EngineConfig  # noqa: E402
from zeroserve.worker.engine import Engine  # noqa: E402
from zeroserve.worker.outputs import StepTiming  # noqa: E402
from zeroserve.worker.sequence import SamplingParams  # noqa: E402

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


def load_hf_model(args: argparse.Namespace, dtype_name: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    from zeroserve.common.model_files import default_model_path

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
    # One copy per dtype, converted once from fp32 (not bf16 -> fp32 round trips).
    return model.to(getattr(torch, dtype_name)).eval()


def warm_up_hf(model, workload: Workload, batch_size: int, pad_id: int) -> None:
    """As zeroserve's warm-up: every prompt once, 4 output tokens, in the measured batches."""
    short = Workload(workload.prompts, [4] * len(workload.prompts))
    run_hf(model, short, str(model.dtype).removeprefix("torch."), batch_size, pad_id)


def run_hf(model, workload: Workload, dtype_name: str, batch_size: int, pad_id: int) -> Result:
    import torch

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


def _key(result: Result) -> str:
    return result.system.split(" (")[0]


def paired(runs: list[list[Result]], a: str, b: str) -> list[float]:
    """a's tokens/s over b's, one ratio per repeat (both measured in that repeat)."""
    out = []
    for results in runs:
        by = {_key(r): r.tokens_per_s for r in results}
        if a in by and b in by:
            out.append(by[a] / by[b])
    return out


def _spread(values: list[float], nd: int = 1, unit: str = "") -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{nd}f}{unit}"
    return f"{med:.{nd}f}{unit} ({min(values):.{nd}f}-{max(values):.{nd}f})"


def print_table(runs: list[list[Result]], repeats: int) -> None:
    """Median tokens/s with min-max over repeats; ratios paired inside each repeat."""
    systems: dict[str, list[Result]] = {}
    for results in runs:
        for r in results:
            systems.setdefault(r.system, []).append(r)
    print(f"Medians of {repeats} repeat(s), (min-max) across them; ratios taken inside each "
          "repeat.")
    print()
    print("| system | output tok/s | wall s | vs static | rows computed | notes |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, rs in systems.items():
        ratios = paired(runs, _key(rs[0]), "zeroserve static")
        ratio = _spread(ratios, 2, "x") if ratios else "n/a"
        print(f"| {name} | {_spread([r.tokens_per_s for r in rs])} "
              f"| {statistics.median(r.wall_s for r in rs):.1f} | {ratio} | {rs[0].num_rows} "
              f"| {rs[0].notes} |")
    for other in sorted({_key(r) for rs in runs for r in rs if _key(r) != "zeroserve continuous"}):
        ratios = paired(runs, "zeroserve continuous", other)
        if ratios:
            print(f"- continuous / {other}: {_spread(ratios, 2, 'x')}")


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
    ap.add_argument("--repeats", type=int, default=5)
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

    runner = None
    warmed_up = False
    hf_models: dict[str, object] = {}  # dtype -> model, loaded and warmed up once
    hf_dtypes = [d.strip() for d in args.hf_dtypes.split(",") if d.strip()]
    pad_id = None
    runs: list[list[Result]] = []  # per repeat
    for rep in range(args.repeats):
        k = rep % len(systems)
        order = systems[k:] + systems[:k]  # rotate, so drift does not favour one system
        print(f"=== repeat {rep + 1}/{args.repeats}: {', '.join(order)} ===", flush=True)
        results: list[Result] = []
        for system in order:
            if system in ENGINE_MODES:
                mode = ENGINE_MODES[system]
                config = engine_config(args, mode)
                if runner is None and args.fake_forward_ms is not None:
                    from zeroserve.worker.fake_runner import FakeRunner

                    runner = FakeRunner(
                        config, forward_time_s=args.fake_forward_ms / 1e3, check_plans=False
                    )
                elif runner is None:
                    from zeroserve.worker.model_runner import ModelRunner

                    runner = ModelRunner(config)
                if not warmed_up:
                    # Whichever mode ran first used to be several times slower: the CPU
                    # kernels build per-shape state on first use. Push every prompt through
                    # once (short outputs) on a throwaway engine, so no mode measures that and
                    # no mode finds the prompts in its prefix cache.
                    Engine(config, runner=runner).generate(
                        workload.prompts, SamplingParams(max_tokens=4, ignore_eos=True)
                    )
                    warmed_up = True
                engine = Engine(config, runner=runner)
                name = f"zeroserve {system} ({runner.info.dtype}, max_num_seqs {args.max_num_seqs})"
                result = run_engine(engine, workload, name, args.max_num_seqs)
                result.notes = (f"{result.num_steps} steps, "
                                f"{engine.stats().num_preemptions} preemptions")
                results.append(result)
                print(f"{result.system}: {result.tokens_per_s:.1f} tok/s", flush=True)
            elif system == "hf":
                if pad_id is None:
                    tokenizer = load_tokenizer()
                    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
                for dtype_name in hf_dtypes:
                    if dtype_name not in hf_models:
                        hf_models[dtype_name] = load_hf_model(args, dtype_name)
                        # The same warm-up as zeroserve's, before the first measured run.
                        warm_up_hf(hf_models[dtype_name], workload, args.max_num_seqs, pad_id)
                    result = run_hf(hf_models[dtype_name], workload, dtype_name,
                                    args.max_num_seqs, pad_id)
                    results.append(result)
                    print(f"{result.system}: {result.tokens_per_s:.1f} tok/s", flush=True)
            else:
                raise SystemExit(f"unknown system {system!r}")
        runs.append(results)

    print()
    print_table(runs, args.repeats)
    results = [r for rs in runs for r in rs]
    continuous = [r for r in results if r.system.startswith("zeroserve continuous")]
    if continuous:
        pooled = Result(continuous[0].system, 0.0, 0,
                        full_steps=[step for r in continuous for step in r.full_steps])
        print()
        print(f"Continuous, steps with {args.max_num_seqs} sequences (all repeats): "
              f"{overhead_summary(pooled)}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    {
                        "repeat": rep,
                        "system": r.system,
                        "tokens_per_s": r.tokens_per_s,
                        "wall_s": r.wall_s,
                        "num_output_tokens": r.num_output_tokens,
                        "num_rows": r.num_rows,
                        "notes": r.notes,
                    }
                    for rep, rs in enumerate(runs)
                    for r in rs
                ],
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
