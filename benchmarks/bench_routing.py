"""Routing benchmark: multi-turn chats over 2 workers, cache-aware vs least-loaded routing.

Starts `zeroserve serve --workers 2 --routing MODE` (the default model on the CPU unless
`--fake`), then runs `--chats` conversations, `--concurrency` at a time in closed loop. A
conversation is a multi-turn ShareGPT chat: its human turns in order (each cut to
`--max-user-chars`), each answered by the model (`--max-tokens` tokens, ignore_eos) whose
reply goes into the history of the next turn, as a chat client does. Each turn's prompt
extends the last one, so a worker that served the chat's last turn holds most of the new
prompt in its prefix cache.

Per mode it reports the prefix-cache hit rate (sum of usage.prompt_tokens_details.
cached_tokens / sum of usage.prompt_tokens, over all turns and over turns 2+), TTFT p50/p90
(all turns and turns 2+), and output tokens/s. Modes alternate (`--repeat` rounds), each on
a fresh server, with the same conversations.

    python benchmarks/bench_routing.py --chats 16 --turns 4 --concurrency 8 --repeat 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from benchmarks.bench_data import dataset_file, iter_conversations  # noqa: E402
from zeroserve.cli.harness import start_server  # noqa: E402

MODES = ("cache_aware", "least_loaded")


@dataclass
class TurnResult:
    chat: int
    turn: int
    ttft_s: float | None = None
    e2e_s: float = 0.0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    text: str = ""
    error: str | None = None


@dataclass
class ModeResult:
    mode: str
    turns: list[TurnResult] = field(default_factory=list)
    wall_s: float = 0.0


def load_conversations(num: int, num_turns: int, max_chars: int) -> list[list[str]]:
    """The first `num` ShareGPT chats with at least `num_turns` human turns (their text)."""
    chats = []
    for conv in iter_conversations(dataset_file()):
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            continue
        human = [t.get("value") for t in turns
                 if isinstance(t, dict) and t.get("from") == "human"]
        human = [h.strip()[:max_chars] for h in human if isinstance(h, str) and h.strip()]
        if len(human) >= num_turns:
            chats.append(human[:num_turns])
            if len(chats) == num:
                break
    if len(chats) < num:
        raise SystemExit(f"only {len(chats)} chats with {num_turns} turns in the dataset")
    return chats


async def one_turn(session: aiohttp.ClientSession, url: str, messages: list[dict],
                   max_tokens: int, result: TurnResult) -> None:
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    result.error = str(event["error"])[:200]
                    return
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text and result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - start
                    result.text += text
                usage = event.get("usage")
                if usage:
                    result.num_prompt_tokens = usage["prompt_tokens"]
                    result.num_output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.num_cached_tokens = details.get("cached_tokens", 0)
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        result.e2e_s = time.perf_counter() - start


async def run_chats(url: str, chats: list[list[str]], concurrency: int,
                    max_tokens: int) -> list[TurnResult]:
    results: list[TurnResult] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for c in range(len(chats)):
        queue.put_nowait(c)
    timeout = aiohttp.ClientTimeout(total=600)

    async def user(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            c = queue.get_nowait()
            messages: list[dict] = []
            for t, text in enumerate(chats[c]):
                messages.append({"role": "user", "content": text})
                result = TurnResult(c, t)
                results.append(result)
                await one_turn(session, url, messages, max_tokens, result)
                if result.error is not None:
                    break
                messages.append({"role": "assistant", "content": result.text})

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(user(session) for _ in range(concurrency)))
    return results


def serve_args(mode: str, args: argparse.Namespace) -> tuple[str, ...]:
    """The `zeroserve serve` flags of one mode's server but --port."""
    flags = ["--device", "cpu", "--workers", "2", "--routing", mode, *args.server_args]
    if args.fake:
        flags += ["--backend", "fake", "--fake-forward-ms", "20"]
    return tuple(flags)


def run_mode(mode: str, chats: list[list[str]], args: argparse.Namespace,
             log_dir: Path) -> ModeResult:
    server = start_server(args=serve_args(mode, args), num_workers=2, port=args.port,
                          log_path=log_dir / f"serve-{mode}-{time.time():.0f}.log",
                          timeout_s=args.ready_timeout)
    url = server.url
    try:
        # Warm both workers up (first forward passes are slow) on a prompt no chat shares.
        warm = [[f"Warm-up {i}: count from one to ten."] for i in range(4)]
        asyncio.run(run_chats(url, warm, 4, 4))
        start = time.perf_counter()
        turns = asyncio.run(run_chats(url, chats, args.concurrency, args.max_tokens))
        return ModeResult(mode, turns, time.perf_counter() - start)
    finally:
        server.stop(timeout_s=60)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(r: ModeResult) -> dict:
    ok = [t for t in r.turns if t.error is None]
    later = [t for t in ok if t.turn > 0]

    def hit_rate(turns: list[TurnResult]) -> float | None:
        prompt = sum(t.num_prompt_tokens for t in turns)
        return sum(t.num_cached_tokens for t in turns) / prompt if prompt else None

    ttft = [t.ttft_s for t in ok if t.ttft_s is not None]
    ttft_later = [t.ttft_s for t in later if t.ttft_s is not None]
    return {
        "mode": r.mode, "num_turns": len(r.turns), "num_errors": len(r.turns) - len(ok),
        "errors": [t.error for t in r.turns if t.error][:3],
        "hit_rate": hit_rate(ok), "hit_rate_turn2plus": hit_rate(later),
        "ttft_p50_ms": 1000 * statistics.median(ttft) if ttft else None,
        "ttft_p90_ms": 1000 * pct(ttft, 0.9) if ttft else None,
        "ttft_turn2plus_p50_ms": 1000 * statistics.median(ttft_later) if ttft_later else None,
        "ttft_turn2plus_p90_ms": 1000 * pct(ttft_later, 0.9) if ttft_later else None,
        "prompt_tokens": sum(t.num_prompt_tokens for t in ok),
        "output_tokens_per_s": sum(t.num_output_tokens for t in ok) / r.wall_s,
        "wall_s": r.wall_s,
    }


def fmt(x: float | None, scale: float = 1.0, nd: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{nd}f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-user-chars", type=int, default=400)
    p.add_argument("--repeat", type=int, default=1, help="rounds of both modes, alternating")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--port", type=int, default=8431)
    p.add_argument("--fake", action="store_true", help="fake backend (no prefix cache hits "
                   "are computed there: for a dry run of the script only)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--json", type=Path, default=None, help="write every summary here")
    p.add_argument("server_args", nargs="*", help="more `zeroserve serve` flags (after --)")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    chats = load_conversations(args.chats, args.turns, args.max_user_chars)
    log_dir = Path(tempfile.mkdtemp(prefix="zeroserve-bench-routing-"))
    summaries = []
    for round_ in range(args.repeat):
        for mode in modes if round_ % 2 == 0 else reversed(modes):
            s = summarize(run_mode(mode, chats, args, log_dir))
            s["round"] = round_
            summaries.append(s)
            print(json.dumps(s), flush=True)
    print(f"\nlogs: {log_dir}")
    print("| routing | round | hit rate (all) | hit rate (turns 2+) | TTFT p50 / p90 ms (all) "
          "| TTFT p50 / p90 ms (turns 2+) | output tok/s | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in summaries:
        print(f"| {s['mode']} | {s['round']} | {fmt(s['hit_rate'], 100)}% "
              f"| {fmt(s['hit_rate_turn2plus'], 100)}% "
              f"| {fmt(s['ttft_p50_ms'], nd=0)} / {fmt(s['ttft_p90_ms'], nd=0)} "
              f"| {fmt(s['ttft_turn2plus_p50_ms'], nd=0)} / {fmt(s['ttft_turn2plus_p90_ms'], nd=0)} "
              f"| {fmt(s['output_tokens_per_s'])} | {s['num_errors']} |")
    if args.json is not None:
        args.json.write_text(json.dumps(summaries, indent=1))
    return 0 if all(s["num_errors"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
