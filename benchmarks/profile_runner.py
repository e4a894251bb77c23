"""Time the model runner's decode step at several batch sizes (no scheduler, no HTTP).

    python benchmarks/profile_runner.py --batch 1 16 32 --context 256 --steps 20 [--profile]
    python benchmarks/profile_runner.py --batch 16 --prefill 128 --prefill-prompts 4 --profile

    python benchmarks/profile_runner.py --batch 1 16 32 --threads 1 --split

Each sequence gets a fresh block table covering `context` tokens (the pool content does not
matter for timing); every step is one decode token per sequence, as in steady-state serving.
First prints the load's time and the process's resident memory after it (the weights: file
pages where mapped from the weight cache); then ms/step, tokens/s and the share of the step spent outside the model forward; on a
shared machine also look at `min` and `cpu` (process CPU time per step, all threads).
`--split` adds where a step's CPU time goes: the layers' block products alone (the same calls
on the model's own weights, as many rows), the lm_head's decode product alone, and the rest
(attention, norms, sampling, Python), with the weights' GB/s; minimum over the steps.
As a worker does, the OpenMP threads' spinning is bounded (worker/omp_env.py) and the CPU class
switch (ZEROSERVE_CPU_CLASS) applies to torch, both before torch loads: with torch's default
spin, 2 threads on a shared machine measure the waits, not the step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zeroserve.worker import cpu_class  # noqa: E402
from zeroserve.worker.omp_env import bound_omp_spinning  # noqa: E402

bound_omp_spinning()
cpu_class.apply_to_environment()

import torch  # noqa: E402

from zeroserve.worker.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, EngineConfig  # noqa: E402
from zeroserve.worker.model_runner import ModelRunner  # noqa: E402
from zeroserve.worker.plan import ScheduledChunk, SchedulerOutput  # noqa: E402
from zeroserve.worker.sequence import SamplingParams  # noqa: E402


def decode_plan(batch: int, context: int, block_size: int, params: SamplingParams,
                num_blocks: int) -> SchedulerOutput:
    blocks_per_seq = (context + block_size) // block_size
    chunks = []
    for i in range(batch):
        first = (i * blocks_per_seq) % max(1, num_blocks - blocks_per_seq)
        table = list(range(first, first + blocks_per_seq))
        chunks.append(ScheduledChunk(f"r{i}", [100 + i], context, table, True, params,
                                     [1] * context, []))
    return SchedulerOutput(chunks)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prefill", type=int, default=0,
                        help="also time one prefill step of prompts of this many tokens")
    parser.add_argument("--prefill-prompts", type=int, default=1,
                        help="prompts in that prefill step (4 x 128 fills the default "
                             "512-token budget)")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    parser.add_argument("--profile", action="store_true", help="print torch.profiler top ops")
    parser.add_argument("--split", action="store_true",
                        help="CPU time of the block products, the lm_head and the rest")
    parser.add_argument("--no-weight-cache", action="store_true",
                        help="prepare the weights in memory instead of mapping the weight cache")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    load_started, load_cpu = time.perf_counter(), time.process_time()
    runner = ModelRunner(EngineConfig(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                                      num_kv_blocks=4000,
                                      attention_backend=args.attention_backend,
                                      weight_cache=not args.no_weight_cache))
    params = SamplingParams(temperature=args.temperature, max_tokens=1000)
    print(f"loaded in {time.perf_counter() - load_started:.2f} s "
          f"({time.process_time() - load_cpu:.2f} s CPU), {memory_after_load()}")
    print(f"device={runner.info.device} dtype={runner.info.dtype} threads={torch.get_num_threads()}"
          f" kv={runner.kv_dtype} context={args.context} attention={args.attention_backend}")
    # The plans' blocks hold values, as a serving pool's do: never-written blocks of the
    # lazily zeroed pool all map the kernel's one zero page, always in cache, so attention
    # over them measured no memory traffic at all (fp32 and bf16 KV alike).
    used = max(args.batch) * ((args.context + runner.block_size) // runner.block_size)
    runner.kv_pool[:, :, :min(used, runner.num_kv_blocks)].normal_(0.0, 0.5)
    if args.prefill:
        time_prefill(runner, args.prefill, args.prefill_prompts, params, args.profile)
    for batch in args.batch:
        plan = decode_plan(batch, args.context, runner.block_size, params, runner.num_kv_blocks)
        for _ in range(3):
            runner.execute(plan)
        totals, forwards, outside, cpu = [], [], [], []
        for _ in range(args.steps):
            started = time.perf_counter()
            cpu_started = time.process_time()
            runner.execute(plan)
            cpu.append(time.process_time() - cpu_started)
            total = time.perf_counter() - started
            timing = runner.last_timing
            totals.append(total)
            forwards.append(timing.forward_s)
            outside.append(total - timing.forward_s)
        ms = statistics.median(totals) * 1e3
        print(f"batch {batch:3d}: {ms:7.2f} ms/step  {batch / ms * 1e3:7.1f} tok/s  "
              f"forward {statistics.median(forwards) * 1e3:7.2f} ms  "
              f"outside forward {statistics.median(outside) * 1e3:5.2f} ms "
              f"({statistics.median(outside) / statistics.median(totals):.1%})  "
              f"min {min(totals) * 1e3:.2f} ms, cpu {statistics.median(cpu) * 1e3:.2f} ms/step")
        if args.split:
            print(step_split(runner, plan, batch, args.steps))
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    runner.execute(plan)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def memory_after_load() -> str:
    """This process's resident memory (Linux): the weights mapped from the weight cache count
    as file pages, those prepared in memory as anonymous ones; the KV pool's untouched pages
    count in neither."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    except OSError:
        return "RSS unknown"
    mb = {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile") if k in fields}
    return (f"RSS {mb.get('VmRSS', 0):.0f} MB (anonymous {mb.get('RssAnon', 0):.0f}, "
            f"file {mb.get('RssFile', 0):.0f})")


def min_cpu_ms(fn, repeats: int) -> float:
    """fn's smallest process CPU time over `repeats` calls, in ms (after one warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        fn()
        best = min(best, time.process_time() - started)
    return best * 1e3


def step_split(runner: ModelRunner, plan: SchedulerOutput, batch: int, repeats: int) -> str:
    """Where a decode step's CPU time goes: the layers' block products (each layer's four, on
    its own weights, `batch` rows of random activations), the lm_head's decode product, the
    rest. Each is timed alone, so its weights stream from memory as in the step (the layers'
    together are larger than the cache)."""
    model = runner.model
    products = [(lin.packed, lin.packed.data.shape[1] * 32) for layer in model.layers
                for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
                if lin.packed is not None and hasattr(lin.packed, "decode_mm")]
    head = model.lm_head.packed
    if not products or head is None or not hasattr(head, "decode_mm"):
        return "  split: the decode rows do not run on the block kernels on this path"
    xs = {cols: torch.randn(batch, cols) for cols in {cols for _, cols in products}}
    xs.setdefault(head.data.shape[1] * 32, torch.randn(batch, head.data.shape[1] * 32))
    step = min_cpu_ms(lambda: runner.execute(plan), repeats)
    layers = min_cpu_ms(lambda: [p.decode_mm(xs[cols]) for p, cols in products], repeats)
    lm_head = min_cpu_ms(lambda: head.decode_mm(xs[head.data.shape[1] * 32]), repeats)
    layer_mb = sum(p.data.numel() for p, _ in products) / 1e6
    head_mb = head.data.numel() / 1e6
    return (f"  split (CPU ms, min of {repeats}): step {step:.2f} = layers' products "
            f"{layers:.2f} ({layer_mb:.0f} MB, {layer_mb / layers:.1f} GB/s) + lm_head "
            f"{lm_head:.2f} ({head_mb:.0f} MB, {head_mb / lm_head:.1f} GB/s, "
            f"{lm_head / step:.0%} of the step) + rest {step - layers - lm_head:.2f}")


def time_prefill(runner: ModelRunner, num_tokens: int, num_prompts: int,
                 params: SamplingParams, with_profile: bool = False) -> None:
    blocks = (num_tokens + runner.block_size - 1) // runner.block_size
    plan = SchedulerOutput([
        ScheduledChunk(f"p{j}", [100 + (i * 7 + j) % 1000 for i in range(num_tokens)], 0,
                       list(range(j * blocks, (j + 1) * blocks)), True, params)
        for j in range(num_prompts)])
    runner.execute(plan)
    times = []
    for _ in range(3):
        started = time.perf_counter()
        runner.execute(plan)
        times.append(time.perf_counter() - started)
    ms = min(times) * 1e3
    total = num_tokens * num_prompts
    print(f"prefill {num_prompts} x {num_tokens} tokens: {ms:.1f} ms "
          f"({total / ms * 1e3:.0f} tok/s)")
    if with_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                runner.execute(plan)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
