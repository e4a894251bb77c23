"""The quality gate: perplexity, KL divergence and top-1 agreement of every path the server can pick.

For each path in PATHS (a flag set of `zeroserve serve`: `--dtype float32 --batch-invariant`,
the exact reference path, greedy equal to transformers; `--dtype float32`; `--dtype bfloat16`;
`--dtype auto`; the int8-activation path where its flag exists; ...), on a fixed English text
(benchmarks/data/python_reference_prose.txt, 6,997 tokens, its source in the README beside it):

- mean negative log-likelihood of the text's tokens, and perplexity exp(mean NLL);
- mean KL divergence KL(reference || path) of the full next-token distributions, against the
  reference path, with its 99th percentile and maximum;
- top-1 agreement: the share of positions where the path's most likely token is the
  reference's (the greedy token the path would pick there, given the same context).

llama.cpp's `llama-perplexity --kl-divergence` is the anchor (its "Mean KLD" and "Same top p").

How the logits are computed: in-process, through the worker's own ModelRunner.execute (the
model runner, kernels and sampler the server runs for that path's flags), with plans built
here as the scheduler would build them, in a fresh interpreter per path with the CPU-class
caps set before torch as the worker sets them (ZEROSERVE_CPU_CLASS). The text is
cut into windows of --context + --scored tokens, one every --scored tokens, so each token
after the first --context + 1 is scored exactly once, with --context to --context + --scored
- 1 tokens before it. Each window is measured twice, since a prompt's rows and a generated
token's rows run different kernels here (worker/model_runner.py `_low_bit_rows`):

- decode mode (what generation computes): the first --context tokens are a prompt (one
  prefill chunk: its first LlamaModel.low_bit_prompt_positions rows on the low-bit kernels,
  the rest on the dense weights), then the text's next tokens are fed one decode step at a
  time (teacher forcing: the "sampled" token is the text's), --batch windows side by side as
  concurrent requests; each decode row's logits are scored. So every scored row is a decode
  row (the low-bit kernels, the native paged decode attention, the fused decode step where
  the path has it), reading a KV cache written by prompt rows and earlier decode rows.
- prompt mode (what a prompt's rows and prompt_logprobs compute): the whole window is one
  prefill chunk of a request with prompt_logprobs, and the logits of the same positions as
  in decode mode are scored: dense-weight rows (all scored positions are past the low-bit
  prompt positions), or with int8 activations the int8 block kernels (Linear.int8_all_rows).

The server's default n-gram speculation is not run: its verify rows are computed as decode
rows of the same positions (worker/model_runner.py `_prepare`), so decode mode stands for it.

The logits are the ones the runner's sampler receives (LlamaModel.compute_logits, watched
for the run), so the lm_head kernel is the server's too. The reference path runs first and
keeps its log-probabilities (fp32, a memory-mapped file in --work-dir: about 1.3 GB per mode
on the defaults); every other path reads them to compute its KL and agreement.

The gate: a path may be a default only if, in both modes, its perplexity is within 0.5% of
the reference path's and its top-1 agreement is at least the bf16 path's (`--dtype
bfloat16`, what `auto` picked on CPUs with native bf16 when the gate was written). The
reference and bf16 paths always run. The script prints a markdown table with PASS or FAIL
per path and writes every figure as JSON (--json).

    python benchmarks/bench_quality.py                          # the default paths, this CPU
    ZEROSERVE_CPU_CLASS=avx512 python benchmarks/bench_quality.py   # a lower CPU class
    python benchmarks/bench_quality.py --paths fp32-reference,bf16,fp32-torch-attention

A path costs about 260 CPU-seconds on the whole text (26 windows; measured on a 2-core
AVX512_BF16 machine); --num-windows N measures the first N windows only, and --work-dir with
--reuse keeps what was measured for a later run (another path, fewer windows).

Adding a path (a new kernel flag) is one line in PATHS; a path whose EngineConfig field does
not exist in this checkout is skipped with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TEXT_PATH = ROOT / "benchmarks" / "data" / "python_reference_prose.txt"
MODES = ("decode", "prompt")
REFERENCE = "fp32-reference"
BASELINE = "bf16"  # the agreement a default must reach
MAX_PPL_CHANGE = 0.005  # a default's perplexity within 0.5% of the reference's


@dataclass(frozen=True)
class QualityPath:
    """One path the server can pick: the EngineConfig fields its flags set."""

    name: str
    engine: dict
    flags: str  # as given to `zeroserve serve`
    is_default_set: bool = True  # measured without --paths


PATHS: tuple[QualityPath, ...] = (
    QualityPath(REFERENCE, {"dtype": "float32", "batch_invariant": True},
                "--dtype float32 --batch-invariant"),
    QualityPath("fp32", {"dtype": "float32"}, "--dtype float32"),
    QualityPath(BASELINE, {"dtype": "bfloat16"}, "--dtype bfloat16"),
    QualityPath("auto", {"dtype": "auto"}, "--dtype auto"),
    QualityPath("fp32+int8", {"dtype": "float32", "int8_activations": True},
                "--dtype float32 --int8-activations"),
    QualityPath("auto+int8", {"dtype": "auto", "int8_activations": True},
                "--dtype auto --int8-activations"),
    QualityPath("auto-no-int8", {"dtype": "auto", "int8_activations": False},
                "--dtype auto --no-int8-activations"),
    QualityPath("fp32+kv-bf16", {"dtype": "float32", "kv_cache_dtype": "bfloat16"},
                "--dtype float32 --kv-cache-dtype bfloat16"),
    QualityPath("auto+kv-bf16", {"dtype": "auto", "kv_cache_dtype": "bfloat16"},
                "--dtype auto --kv-cache-dtype bfloat16"),
    QualityPath("fp32-torch-attention", {"dtype": "float32", "attention_backend": "torch"},
                "--dtype float32 --attention-backend torch", is_default_set=False),
    QualityPath("bf16-torch-attention", {"dtype": "bfloat16", "attention_backend": "torch"},
                "--dtype bfloat16 --attention-backend torch", is_default_set=False),
    QualityPath("fp32-compiled", {"dtype": "float32", "enforce_eager": False},
                "--dtype float32 --no-enforce-eager", is_default_set=False),
)


def engine_fields() -> set[str]:
    from zeroserve.worker.config import EngineConfig

    return {f.name for f in dataclasses.fields(EngineConfig)}


def choose_paths(names: list[str] | None, known: set[str]) -> tuple[list[QualityPath], list[str]]:
    """The paths to run, reference and baseline first (always run), and a note for each one
    left out because this checkout's EngineConfig lacks one of its fields."""
    by_name = {p.name: p for p in PATHS}
    unknown = [n for n in names or [] if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown path(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    wanted = names if names else [p.name for p in PATHS if p.is_default_set]
    ordered = [REFERENCE, BASELINE] + [n for n in wanted if n not in (REFERENCE, BASELINE)]
    chosen, skipped = [], []
    for name in ordered:
        missing = sorted(set(by_name[name].engine) - known)
        if missing:
            skipped.append(f"{name}: not in this checkout (EngineConfig has no "
                           f"{', '.join(missing)})")
        else:
            chosen.append(by_name[name])
    return chosen, skipped


# --- the arithmetic (pure, tested in tests/benchmarks/test_bench_quality.py) ----------------

def window_starts(num_tokens: int, context: int, scored: int) -> list[int]:
    """Window starts, one every `scored` tokens: window s feeds tokens s .. s+context+scored-1
    and scores the predictions of tokens s+context+1 .. s+context+scored, so consecutive
    windows score consecutive runs and no token twice."""
    last = num_tokens - 1 - context - scored  # the last target must be a token of the text
    return list(range(0, last + 1, scored)) if last >= 0 else []


def row_stats(logits, ref_logprobs, targets):
    """Per row: NLL of the target, KL(reference || this), this row's and the reference's
    argmax. logits [rows, vocab] (any float dtype), ref_logprobs [rows, vocab] fp32
    log-probabilities, targets [rows] token ids -> four [rows] tensors."""
    import torch

    logprobs = torch.log_softmax(logits.float(), dim=-1)
    nll = -logprobs.gather(1, targets[:, None].long())[:, 0]
    ref = ref_logprobs.float()
    p = ref.exp()
    # p log(p/q), 0 where p is 0 (also where q is 0 there: 0 * inf is 0 here, not NaN)
    terms = torch.where(p > 0, p * (ref - logprobs), torch.zeros_like(p))
    kl = terms.sum(dim=-1).clamp_min(0.0)  # rounding may leave -1e-9 for equal rows
    return nll.double(), kl.double(), logprobs.argmax(dim=-1), ref.argmax(dim=-1)


@dataclass(frozen=True)
class Metrics:
    num_tokens: int
    mean_nll: float
    perplexity: float
    mean_kl: float
    kl_p99: float
    kl_max: float
    top1_agreement: float  # share of positions whose argmax is the reference's

    @classmethod
    def of(cls, nll: list[float], kl: list[float], agree: list[bool]) -> Metrics:
        if not nll or not (len(nll) == len(kl) == len(agree)):
            raise ValueError("need the same, non-zero number of NLL, KL and agreement values")
        mean_nll = math.fsum(nll) / len(nll)
        ordered = sorted(kl)
        return cls(num_tokens=len(nll), mean_nll=mean_nll, perplexity=math.exp(mean_nll),
                   mean_kl=math.fsum(kl) / len(kl), kl_p99=_percentile(ordered, 0.99),
                   kl_max=ordered[-1], top1_agreement=sum(agree) / len(agree))


def _percentile(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values, linear between the two nearest ranks."""
    rank = q * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reasons: list[str] = field(default_factory=list)  # why not, one per failed mode and rule


def gate(results: dict[str, dict[str, Metrics]], reference: str = REFERENCE,
         baseline: str = BASELINE, max_ppl_change: float = MAX_PPL_CHANGE
         ) -> dict[str, Verdict]:
    """The rule, per path, over every mode it was measured in: perplexity within
    `max_ppl_change` (relative, either way) of the reference path's, and top-1 agreement with
    the reference at least the baseline path's, in each mode. results: path -> mode ->
    Metrics; the reference and the baseline must be among them."""
    for needed in (reference, baseline):
        if needed not in results:
            raise ValueError(f"the gate needs the {needed} path's figures")
    verdicts = {}
    for name, modes in results.items():
        reasons = []
        for mode, m in modes.items():
            ref, base = results[reference][mode], results[baseline][mode]
            change = m.perplexity / ref.perplexity - 1
            if abs(change) > max_ppl_change:
                reasons.append(f"{mode}: perplexity {m.perplexity:.4f} is {change:+.2%} from "
                               f"{reference}'s {ref.perplexity:.4f} (allowed "
                               f"{max_ppl_change:.1%})")
            if m.top1_agreement < base.top1_agreement:
                reasons.append(f"{mode}: top-1 agreement {m.top1_agreement:.2%} below "
                               f"{baseline}'s {base.top1_agreement:.2%}")
        verdicts[name] = Verdict(not reasons, reasons)
    return verdicts


def table(results: dict[str, dict[str, Metrics]], verdicts: dict[str, Verdict],
          flags: dict[str, str], reference: str = REFERENCE) -> str:
    """The markdown table: one row per path and mode."""
    lines = ["| path | flags | mode | PPL | vs ref | mean NLL | mean KL | KL p99 | KL max "
             "| top-1 agree | gate |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, modes in results.items():
        for mode, m in modes.items():
            ref = results[reference][mode]
            verdict = "PASS" if verdicts[name].passed else "FAIL"
            lines.append(
                f"| {name} | `{flags[name]}` | {mode} | {m.perplexity:.4f} | "
                f"{m.perplexity / ref.perplexity - 1:+.3%} | {m.mean_nll:.5f} | "
                f"{m.mean_kl:.6f} | {m.kl_p99:.5f} | {m.kl_max:.4f} | "
                f"{m.top1_agreement:.2%} | {verdict} |")
    return "\n".join(lines)


# --- one path, in its own interpreter (--child) ---------------------------------------------

def run_child(args: argparse.Namespace) -> None:
    """Compute one path's per-row figures into the work dir (the reference's also writes
    its log-probabilities for the others)."""
    from zeroserve.worker import cpu_class
    from zeroserve.worker.omp_env import bound_omp_spinning

    bound_omp_spinning()  # as the worker command does, before torch
    cpu_class.apply_to_environment()

    import numpy as np
    import torch

    from zeroserve.worker.config import EngineConfig
    from zeroserve.worker.model_runner import ModelRunner

    work = Path(args.work_dir)
    spec = json.loads((work / "spec.json").read_text())
    path = {p.name: p for p in PATHS}[args.child]
    tokens = spec["tokens"]
    context, scored, batch = spec["context"], spec["scored"], spec["batch"]
    starts = spec["starts"]
    blocks_per_window = math.ceil((context + scored) / spec["block_size"])
    started, cpu_started = time.perf_counter(), time.process_time()
    runner = ModelRunner(EngineConfig(
        model=spec["model"], device="cpu", block_size=spec["block_size"],
        num_kv_blocks=max(batch, 1) * blocks_per_window, max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(512, context + scored), enable_prefix_caching=False,
        **path.engine))
    load_s = time.perf_counter() - started
    captured = watch_logits(runner)
    out: dict[str, np.ndarray] = {}
    timings = {}
    for mode in MODES:
        num_rows = len(starts) * scored
        ref_file = work / f"reference-{mode}.npy"
        if path.name == REFERENCE:
            ref = np.lib.format.open_memmap(ref_file, mode="w+", dtype=np.float32,
                                            shape=(num_rows, runner.info.vocab_size))
        else:
            ref = np.load(ref_file, mmap_mode="r")
        stats = {k: np.zeros(num_rows, dtype=dtype) for k, dtype in (
            ("nll", np.float64), ("kl", np.float64), ("top1", np.int64),
            ("ref_top1", np.int64))}
        t0, c0 = time.perf_counter(), time.process_time()
        rows = (decode_rows if mode == "decode" else prompt_rows)(
            runner, captured, tokens, starts, context, scored, batch, blocks_per_window)
        for first_row, logits in rows:
            end = first_row + logits.shape[0]
            targets = torch.tensor([tokens[starts[r // scored] + context + r % scored + 1]
                                    for r in range(first_row, end)])
            if path.name == REFERENCE:
                ref[first_row:end] = torch.log_softmax(logits.float(), dim=-1).numpy()
            nll, kl, top1, ref_top1 = row_stats(
                logits, torch.from_numpy(np.array(ref[first_row:end])), targets)
            for key, value in (("nll", nll), ("kl", kl), ("top1", top1),
                               ("ref_top1", ref_top1)):
                stats[key][first_row:end] = value.numpy()
        if path.name == REFERENCE:
            ref.flush()
        timings[mode] = {"wall_s": time.perf_counter() - t0,
                         "cpu_s": time.process_time() - c0}
        out.update({f"{mode}_{k}": v for k, v in stats.items()})
    np.savez(work / f"{path.name}.npz", **out)
    (work / f"{path.name}.json").write_text(json.dumps({
        "kernels": describe_kernels(runner), "load_s": load_s, "modes": timings,
        "total_wall_s": time.perf_counter() - started,
        "total_cpu_s": time.process_time() - cpu_started,
        "cpu_class": cpu_class.effective().describe()}))


def watch_logits(runner) -> list:
    """Every logits tensor the runner's model computes from now on (the sampler's rows and
    the prompt logprobs' rows, in the order of the calls), appended to the list returned."""
    captured: list = []
    compute_logits = runner.model.compute_logits

    def watched(hidden, *args, **kwargs):
        logits = compute_logits(hidden, *args, **kwargs)
        captured.append(logits.clone())  # the sampler may change its copy in place
        return logits

    runner.model.compute_logits = watched
    return captured


def _params(prompt_logprobs: int | None = None):
    from zeroserve.worker.sequence import SamplingParams

    return SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True,
                          prompt_logprobs=prompt_logprobs)


def decode_rows(runner, captured, tokens, starts, context, scored, batch, blocks_per_window):
    """Decode mode: --batch windows at a time, each prompted with its first `context` tokens
    (one prefill chunk per step), then fed its next tokens one decode step at a time, all
    windows in each step. Yields (first row, logits [rows, vocab]) per step."""
    from zeroserve.worker.plan import ScheduledChunk, SchedulerOutput

    params = _params()
    for group_start in range(0, len(starts), batch):
        group = list(range(group_start, min(group_start + batch, len(starts))))
        tables = {w: list(range(i * blocks_per_window, (i + 1) * blocks_per_window))
                  for i, w in enumerate(group)}
        prompts = {w: tokens[starts[w]:starts[w] + context] for w in group}
        for w in group:
            runner.execute(SchedulerOutput([ScheduledChunk(
                f"w{w}", prompts[w], 0, tables[w], True, params, prompts[w], [])]))
        for j in range(scored):
            chunks = []
            for w in group:
                fed = tokens[starts[w] + context:starts[w] + context + j + 1]
                chunks.append(ScheduledChunk(f"w{w}", [fed[-1]], context + j, tables[w], True,
                                             params, prompts[w], fed))
            captured.clear()
            runner.execute(SchedulerOutput(chunks))
            (logits,) = captured  # one row per window, in plan order
            for i, w in enumerate(group):
                yield w * scored + j, logits[i:i + 1]


def prompt_rows(runner, captured, tokens, starts, context, scored, batch, blocks_per_window):
    """Prompt mode: each window as one prefill chunk of a request with prompt_logprobs (not
    its last chunk, so nothing is sampled: the watched logits are the prompt rows' only).
    Yields (first row, logits [scored, vocab]) per window."""
    import torch

    from zeroserve.worker.plan import ScheduledChunk, SchedulerOutput

    params = _params(prompt_logprobs=0)
    table = list(range(blocks_per_window))
    for w, start in enumerate(starts):
        prompt = tokens[start:start + context + scored + 1]
        captured.clear()
        runner.execute(SchedulerOutput([ScheduledChunk(
            f"p{w}", prompt[:-1], 0, table, False, params, prompt, [])]))
        logits = torch.cat(captured)  # [context + scored, vocab]: row p predicts token p + 1
        if logits.shape[0] != context + scored:
            raise RuntimeError(f"expected {context + scored} prompt rows, got {logits.shape[0]}")
        yield w * scored, logits[context:]


def describe_kernels(runner) -> dict:
    """Which kernels the runner's rows take, as far as the runner tells."""
    model = runner.model
    layer = model.layers[0]
    packed = layer.qkv.packed
    return {
        "dtype": str(runner.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(getattr(runner, "kv_dtype", runner.dtype)).removeprefix("torch."),
        "decode_rows": (type(packed).__name__ if packed is not None else "dense")
        + (" int8 activations" if getattr(packed, "int8_activations", False) else ""),
        "decode_step": ("fused native decode_layers" if getattr(model, "_fused", None)
                        else "per layer") if runner.decode_step is None
        else type(runner.decode_step).__name__,
        "decode_attention": "native" if runner.decode_kernel is not None else "torch",
        "prompt_rows_dense_dtype": ("none (int8 rows)" if layer.qkv.dense is None
                                    else str(layer.qkv.dense.dtype).removeprefix("torch.")),
        "low_bit_prompt_positions": model.low_bit_prompt_positions,
        "prompt_rows_int8": bool(getattr(layer.qkv, "int8_all_rows", False)
                                 and getattr(packed, "int8_activations", False)),
        "lm_head": type(model.lm_head.packed).__name__ if model.lm_head.packed is not None
        else "dense",
    }


# --- the parent: every path, the gate, the table --------------------------------------------

def machine() -> dict:
    from zeroserve.worker import cpu_class

    flags = cpu_class.cpu_flags() or frozenset()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout
    except OSError:
        commit, dirty = "", ""
    return {"cpu_class": cpu_class.effective().describe(),
            "cpu_flags": sorted(flags & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16",
                                         "amx_tile", "amx_bf16", "amx_int8"}),
            "commit": commit + ("+uncommitted" if dirty.strip() else ""),
            "load_average": os.getloadavg()[0]}


def run_parent(args: argparse.Namespace) -> int:
    from zeroserve.gateway.text.tokenizer import load_tokenizer
    from zeroserve.worker.cpu_class import ENV_VAR

    names = [n.strip() for n in args.paths.split(",") if n.strip()] if args.paths else None
    paths, skipped = choose_paths(names, engine_fields())
    tokens = load_tokenizer(args.model).encode(TEXT_PATH.read_text(), add_special_tokens=False)
    starts = window_starts(len(tokens), args.context, args.scored)
    if args.num_windows:
        starts = starts[:args.num_windows]
    if not starts:
        raise SystemExit(f"the text ({len(tokens)} tokens) is shorter than one window")
    print(f"{TEXT_PATH.name}: {len(tokens)} tokens, {len(starts)} windows of {args.context} + "
          f"{args.scored}, {len(starts) * args.scored} scored positions per mode; paths: "
          f"{', '.join(p.name for p in paths)}", flush=True)
    for note in skipped:
        print(f"skipped {note}", flush=True)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="bench_quality-"))
    work.mkdir(parents=True, exist_ok=True)
    spec = {"tokens": tokens, "starts": starts, "context": args.context, "scored": args.scored,
            "batch": args.batch, "model": args.model, "block_size": args.block_size,
            "cpu_class": os.environ.get(ENV_VAR, "native")}
    spec_file = work / "spec.json"
    reusable = args.reuse and spec_file.is_file() and is_prefix_run(
        spec, json.loads(spec_file.read_text()))
    if not reusable:  # figures of another text, window shape or class: never taken
        for stale in (*work.glob("*.npz"), *work.glob("*.json")):
            stale.unlink()
    spec_file.write_text(json.dumps(spec))
    num_rows = len(starts) * args.scored
    results: dict[str, dict[str, Metrics]] = {}
    runs: dict[str, dict] = {}
    failed: dict[str, str] = {}
    try:
        for path in paths:
            if reusable and measured_rows(work / f"{path.name}.npz") >= num_rows:
                print(f"=== {path.name}: reusing {work / path.name}.npz ===", flush=True)
                runs[path.name] = json.loads((work / f"{path.name}.json").read_text())
            else:
                reusable = reusable and path.name != REFERENCE  # new reference, new figures
                error = run_path(path, work, runs)
                if error:
                    if path.name in (REFERENCE, BASELINE):
                        raise SystemExit(f"{path.name}: {error}")
                    failed[path.name] = error
                    print(f"{path.name}: {error}", flush=True)
                    continue
            results[path.name] = load_metrics(work / f"{path.name}.npz", num_rows)
            print(f"{path.name}: " + ", ".join(
                f"{mode} PPL {m.perplexity:.4f} KL {m.mean_kl:.6f} top-1 {m.top1_agreement:.2%}"
                for mode, m in results[path.name].items()), flush=True)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    verdicts = gate(results)
    flags = {p.name: p.flags for p in paths}
    print()
    print(table(results, verdicts, flags))
    print()
    for name, run in runs.items():
        print(f"{name}: {kernels_line(run['kernels'])}")
    for name, verdict in verdicts.items():
        for reason in verdict.reasons:
            print(f"{name} FAIL: {reason}")
    for name, error in failed.items():
        print(f"{name} not measured: {error}")
    engines = {p.name: p.engine for p in paths}
    report = {
        "machine": machine(), "model": args.model,
        "text": {"file": str(TEXT_PATH.relative_to(ROOT)), "num_tokens": len(tokens)},
        "windows": {"count": len(starts), "context": args.context, "scored": args.scored,
                    "batch": args.batch},
        "gate": {"reference": REFERENCE, "baseline": BASELINE,
                 "max_perplexity_change": MAX_PPL_CHANGE},
        "skipped": skipped, "failed": failed,
        "paths": {name: {"flags": flags[name], "engine": engines[name],
                         "modes": {mode: dataclasses.asdict(m) for mode, m in modes.items()},
                         "gate": dataclasses.asdict(verdicts[name]), "run": runs[name]}
                  for name, modes in results.items()},
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")
    required = [n.strip() for n in args.require.split(",") if n.strip()]
    not_passing = [n for n in required if n not in verdicts or not verdicts[n].passed]
    if not_passing:
        print(f"required path(s) not passing the gate: {', '.join(not_passing)}")
        return 1
    return 0


def run_path(path: QualityPath, work: Path, runs: dict[str, dict]) -> str | None:
    """One path in its own interpreter (this one's environment: the CPU class); what went
    wrong, or None."""
    print(f"=== {path.name} ({path.flags}) ===", flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child",
                           path.name, "--work-dir", str(work)], cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        return f"exited {proc.returncode}"
    runs[path.name] = json.loads((work / f"{path.name}.json").read_text())
    runs[path.name]["child_cpu_s"] = (after.ru_utime + after.ru_stime
                                      - before.ru_utime - before.ru_stime)
    return None


def kernels_line(kernels: dict) -> str:
    return (f"{kernels['dtype']} activations, {kernels.get('kv_cache_dtype', '?')} KV cache; "
            f"decode rows {kernels['decode_rows']} "
            f"({kernels['decode_step']}, {kernels['decode_attention']} attention); prompt rows "
            + ("all on the decode rows' int8 block kernels" if kernels.get("prompt_rows_int8")
               else f"from position {kernels['low_bit_prompt_positions']} dense "
               f"{kernels['prompt_rows_dense_dtype']}")
            + f"; lm_head {kernels['lm_head']}")


def is_prefix_run(new: dict, old: dict) -> bool:
    """Whether a run of spec `new` may take the figures measured under spec `old`: the same
    text, model, window shape and CPU class, and its windows the first of `old`'s (rows are
    numbered window by window, so the first windows' rows are the same rows)."""
    same = all(old.get(k) == v for k, v in new.items() if k != "starts")
    return same and old.get("starts", [])[:len(new["starts"])] == new["starts"]


def measured_rows(npz_path: Path) -> int:
    """How many rows a path's figures in the work dir cover (0: none there)."""
    import numpy as np

    if not npz_path.is_file():
        return 0
    with np.load(npz_path) as data:
        return min(len(data[f"{mode}_nll"]) for mode in MODES)


def load_metrics(npz_path: Path, num_rows: int | None = None) -> dict[str, Metrics]:
    """A path's figures per mode, from its first `num_rows` rows (None: all)."""
    import numpy as np

    data = np.load(npz_path)
    rows = slice(None, num_rows)
    return {mode: Metrics.of(data[f"{mode}_nll"][rows].tolist(),
                             data[f"{mode}_kl"][rows].tolist(),
                             (data[f"{mode}_top1"][rows] == data[f"{mode}_ref_top1"][rows]).tolist())
            for mode in MODES}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="The quality gate: for each path the server can pick, the perplexity of "
        "a fixed English text, the KL divergence of the full next-token distributions against "
        "the fp32 reference path and the share of positions whose top-1 token agrees with it, "
        "on decode rows and on prompt rows; PASS or FAIL per path as a default.",
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default="",
                    help="comma list of paths (default: every default-set path this checkout "
                    "has); known: " + ", ".join(p.name for p in PATHS))
    ap.add_argument("--model", default="default", help="as zeroserve serve's --model")
    ap.add_argument("--context", type=int, default=256,
                    help="tokens before a window's first scored position")
    ap.add_argument("--scored", type=int, default=256, help="scored positions per window")
    ap.add_argument("--batch", type=int, default=16,
                    help="windows decoded side by side (concurrent requests)")
    ap.add_argument("--num-windows", type=int, default=0,
                    help="only the first N windows (a quick look; default: the whole text)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json", default=str(ROOT / ".bench" / "results" / "bench_quality.json"),
                    help="where the figures go")
    ap.add_argument("--work-dir", default="",
                    help="keep the reference log-probabilities and per-row figures here "
                    "(default: a temporary folder, removed at the end)")
    ap.add_argument("--reuse", action="store_true",
                    help="with --work-dir: take the figures of paths already measured there "
                    "for the same text, window shape and CPU class (on as many windows or "
                    "more) instead of running them again (all of them again when the "
                    "reference runs again)")
    ap.add_argument("--require", default="",
                    help="comma list of paths that must pass the gate, else exit 1")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.context < 1 or args.scored < 1 or not 1 <= args.batch <= 256:
        ap.error("--context and --scored must be >= 1, --batch in 1..256")
    if args.reuse and not args.work_dir:
        ap.error("--reuse needs --work-dir")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return 0
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
