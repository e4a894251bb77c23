"""n-gram speculative decoding, on against off: one client (c1), greedy, fixed output length.

Two servers run side by side (the same model and flags but --speculative-config); each
repeat sends the same requests to one, then the other (which one goes first alternates), one
request at a time, so neither competes with the other for the CPU. Reported per server:
output tokens/s over the repeats, their ratio, whether the texts are identical, and the
acceptance rate from the speculating server's /metrics.

Workloads:
- grounded: input-grounded prompts (repeat, rewrite, extract from a given text), where the
  output repeats the input and n-gram drafts are often right.
- chat: the ShareGPT chat mix (benchmarks/bench_data.py), where drafts are rare: what
  speculation costs when it does not pay.

    python benchmarks/bench_speculative.py --workload grounded --repeats 3 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zeroserve.cli.harness import start_server  # noqa: E402
from zeroserve.worker.speculative import SpeculativeConfig  # noqa: E402

DEFAULT_SPEC = SpeculativeConfig().to_json()  # what `zeroserve serve` runs without the flag


def grounded_messages() -> list[list[dict]]:
    from benchmarks.bench_data import GROUNDED_INSTRUCTIONS, GROUNDED_PASSAGES

    return [[{"role": "user", "content": f"{instruction}\n\n{passage}"}]
            for instruction, passage in zip(GROUNDED_INSTRUCTIONS, GROUNDED_PASSAGES[:3],
                                            strict=True)]


def chat_messages(num: int) -> list[list[dict]]:
    from benchmarks.bench_data import load_chat_samples

    return [s.messages for s in load_chat_samples(num, seed=0, max_prompt_tokens=512)]


def one_round(url: str, messages: list[list[dict]], output_len: int) -> tuple[int, float,
                                                                                list[str]]:
    """Sends each request in turn; (output tokens, seconds, texts)."""
    num_tokens, texts = 0, []
    started = time.perf_counter()
    with httpx.Client(base_url=url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for m in messages:
            r = client.post("/v1/chat/completions", json={
                "model": model, "messages": m, "max_tokens": output_len,
                "temperature": 0.0, "ignore_eos": True})
            r.raise_for_status()
            body = r.json()
            num_tokens += body["usage"]["completion_tokens"]
            texts.append(body["choices"][0]["message"]["content"])
    return num_tokens, time.perf_counter() - started, texts


def spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if line.startswith(f"zeroserve:spec_decode_{name}_total{{"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        if line.startswith("zeroserve:spec_decode_num_accepted_tokens_per_pos_total{"):
            position = line.split('position="', 1)[1].split('"', 1)[0]
            key = f"pos{position}"
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def per_position(before: dict[str, float], after: dict[str, float]) -> list[float]:
    """The share of verified proposals whose draft at each position was accepted."""
    num_drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    if not num_drafts:
        return []
    shares, i = [], 0
    while f"pos{i}" in after:
        shares.append((after[f"pos{i}"] - before.get(f"pos{i}", 0)) / num_drafts)
        i += 1
    return shares


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=["grounded", "chat"], default="grounded")
    ap.add_argument("--num-prompts", type=int, default=3, help="chat only (grounded: 3)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--speculative-config", default=DEFAULT_SPEC)
    ap.add_argument("--serve-args", default="", help="extra flags for both servers")
    ap.add_argument("--result-json", type=Path, default=None)
    args = ap.parse_args(argv)

    messages = grounded_messages() if args.workload == "grounded" else \
        chat_messages(args.num_prompts)
    extra = tuple(args.serve_args.split())
    servers = {
        "off": start_server(args=("--speculative-config", "null", *extra)),
        "on": start_server(args=("--speculative-config", args.speculative_config, *extra)),
    }
    rates: dict[str, list[float]] = {"off": [], "on": []}
    texts: dict[str, list[str]] = {}
    try:
        urls = {name: f"http://127.0.0.1:{s.port}" for name, s in servers.items()}
        for name in servers:  # warm-up: first requests pay one-time costs
            one_round(urls[name], messages[:1], 8)
        before = spec_counters(urls["on"])
        for repeat in range(args.repeats):
            order = ["off", "on"] if repeat % 2 == 0 else ["on", "off"]
            for name in order:
                num_tokens, seconds, got = one_round(urls[name], messages, args.output_len)
                rates[name].append(num_tokens / seconds)
                texts.setdefault(name, got)
                print(f"repeat {repeat + 1} {name:>3}: {num_tokens / seconds:6.1f} tok/s "
                      f"({num_tokens} tokens in {seconds:.1f} s)", flush=True)
        after = spec_counters(urls["on"])
    finally:
        for s in servers.values():
            s.stop()
    drafted = after.get("num_draft_tokens", 0) - before.get("num_draft_tokens", 0)
    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    summary = {
        "workload": args.workload, "output_len": args.output_len,
        "num_requests": len(messages), "repeats": args.repeats,
        "speculative_config": json.loads(args.speculative_config),
        "off_tok_s": rates["off"], "on_tok_s": rates["on"], "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "identical_texts": texts["on"] == texts["off"],
        "acceptance_rate": accepted / drafted if drafted else None,
        "num_drafts": after.get("num_drafts", 0) - before.get("num_drafts", 0),
        "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
        "accepted_per_position": per_position(before, after),
    }
    print(f"off {statistics.median(rates['off']):.1f} tok/s, on "
          f"{statistics.median(rates['on']):.1f} tok/s (medians); ratio per repeat "
          f"{', '.join(f'{r:.2f}' for r in ratios)}; identical texts: "
          f"{summary['identical_texts']}; acceptance "
          f"{'n/a' if not drafted else f'{accepted / drafted:.2f}'} "
          f"({int(accepted)} of {int(drafted)} draft tokens in "
          f"{int(summary['num_drafts'])} proposals); accepted at positions 1..: "
          f"{', '.join(f'{x:.2f}' for x in summary['accepted_per_position']) or 'n/a'}")
    if args.result_json is not None:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
