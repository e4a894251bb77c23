"""Check benchmarks/bench_serving.py against vLLM's `vllm-rs bench serve` on one running server.

Both clients send the same ShareGPT prompts (exported as a JSONL `custom` dataset for vLLM)
to /v1/chat/completions with the same output length, `ignore_eos`, temperature 0 and
concurrency, one after the other, alternating who goes first; every prompt is sent once
beforehand so a server's prompt cache treats all measured runs alike; the table shows the figures side by side. vllm-rs exits 0
even when requests fail, so its JSON is read and its failures reported.

    benchmarks/fetch_vllm_bench.sh
    python benchmarks/crosscheck_vllm.py --base-url http://127.0.0.1:8080 --concurrency 16 \\
        --num-prompts 48 --output-len 128 [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_data import BENCH_DIR, TOKENIZER_DIR, load_chat_samples  # noqa: E402
from benchmarks.bench_serving import BenchConfig, run  # noqa: E402

VLLM_RS = BENCH_DIR / "vllm" / "vllm-rs"
ROWS = [  # (label, our summary path, vLLM JSON key)
    ("completed", "completed", "completed"),
    ("failed", "failed", "failed"),
    ("output tok/s", "output_throughput", "output_throughput"),
    ("request/s", "request_throughput", "request_throughput"),
    ("TTFT mean ms", "ttft_ms.mean", "mean_ttft_ms"),
    ("TTFT p50 ms", "ttft_ms.p50", "median_ttft_ms"),
    ("TTFT p99 ms", "ttft_ms.p99", "p99_ttft_ms"),
    ("TPOT mean ms", "tpot_ms.mean", "mean_tpot_ms"),
    ("TPOT p50 ms", "tpot_ms.p50", "median_tpot_ms"),
    ("ITL mean ms", "itl_ms.mean", "mean_itl_ms"),
    ("ITL p50 ms", "itl_ms.p50", "median_itl_ms"),
    ("ITL p99 ms", "itl_ms.p99", "p99_itl_ms"),
    ("E2E mean ms", "e2e_ms.mean", "mean_e2el_ms"),
    ("E2E p50 ms", "e2e_ms.p50", "median_e2el_ms"),
]


def run_vllm(base_url: str, samples, cfg: BenchConfig, out_dir: Path) -> dict:
    data = out_dir / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": s.messages[-1]["content"]}) + "\n"
                            for s in samples))
    result = out_dir / "vllm.json"
    cmd = [str(VLLM_RS), "bench", "serve", "--backend", "openai-chat",
           "--base-url", base_url, "--endpoint", "/v1/chat/completions",
           "--tokenizer", str(TOKENIZER_DIR), "--dataset-name", "custom",
           "--dataset-path", str(data), "--custom-output-len", str(cfg.output_len),
           "--num-prompts", str(len(samples)), "--request-rate", "inf",
           "--max-concurrency", str(cfg.concurrency), "--ignore-eos", "--temperature", "0",
           "--num-warmups", str(cfg.num_warmup), "--no-oversample",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", result.name,
           "--disable-tqdm"]
    if cfg.model:
        cmd += ["--model", cfg.model]
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if not result.is_file():
        raise RuntimeError(f"vllm-rs wrote no result (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    out = json.loads(result.read_text())
    out["_stdout_tail"] = proc.stdout[-1500:]
    return out


def _dig(d: dict, path: str):
    for part in path.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="alternate the two clients")
    ap.add_argument("--out-dir", type=Path, default=BENCH_DIR / "results" / "crosscheck")
    a = ap.parse_args(argv)
    if not VLLM_RS.is_file():
        print(f"{VLLM_RS} is missing: run benchmarks/fetch_vllm_bench.sh", file=sys.stderr)
        return 2
    samples = load_chat_samples(a.num_prompts)
    cfg = BenchConfig(base_url=a.base_url, model=a.model, num_prompts=a.num_prompts,
                      concurrency=a.concurrency, output_len=a.output_len, num_warmup=2,
                      show_progress=False)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    # Servers with a prompt/prefix cache (llama-server, zeroserve) would serve whichever client
    # runs second from cache; one pass over every prompt first makes all measured runs warm.
    run(replace(cfg, output_len=2, num_warmup=0), samples)
    ours, theirs = [], []
    for rep in range(a.repeats):
        with tempfile.TemporaryDirectory(dir=a.out_dir) as tmp:
            first_vllm = rep % 2 == 1
            if first_vllm:
                theirs.append(run_vllm(a.base_url, samples, cfg, Path(tmp)))
            ours.append(run(cfg, samples))
            if not first_vllm:
                theirs.append(run_vllm(a.base_url, samples, cfg, Path(tmp)))
    print(f"\n{a.base_url}: concurrency {a.concurrency}, {a.num_prompts} prompts, "
          f"{a.output_len} output tokens, {a.repeats} repeat(s) (run {{i}}: ours / vllm-rs)")
    header = f"{'metric':<16}" + "".join(
        f"{f'ours #{i + 1}':>12}{f'vllm #{i + 1}':>12}{'ratio':>8}" for i in range(a.repeats))
    print(header)
    table = []
    for label, ours_key, vllm_key in ROWS:
        cells, row = "", {"metric": label}
        for i in range(a.repeats):
            x, y = _dig(ours[i], ours_key), theirs[i].get(vllm_key)
            ratio = (x / y) if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else None
            cells += f"{_f(x):>12}{_f(y):>12}{_f(ratio, 2):>8}"
            row[f"ours_{i}"], row[f"vllm_{i}"] = x, y
        print(f"{label:<16}{cells}")
        table.append(row)
    for i, s in enumerate(ours):
        print(f"ours #{i + 1}: token mismatches {s['token_mismatches']}, errors {s['error_examples']}")
    for i, t in enumerate(theirs):
        errs = [e for e in (t.get("errors") or []) if e][:3]
        print(f"vllm #{i + 1}: failed {t.get('failed')}, total output tokens "
              f"{t.get('total_output_tokens')}, errors {errs}")
    (a.out_dir / "crosscheck.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(a).items()}, "table": table,
         "vllm": [{k: v for k, v in t.items() if not isinstance(v, list)} for t in theirs],
         "ours": [{k: v for k, v in s.items() if k not in ("requests", "itl_samples_ms")}
                  for s in ours]}, indent=1))
    return 0


def _f(x, nd=1) -> str:
    if x is None:
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


if __name__ == "__main__":
    raise SystemExit(main())
