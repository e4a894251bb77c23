"""Serving benchmark for any OpenAI-compatible server (zeroserve, llama-server, vLLM, ...).

Metrics follow vLLM's serving benchmark (see BENCH.md and docs/benchmarks.md):

- TTFT: request sent -> first streamed chunk with text.
- E2E: request sent -> last byte of the response.
- TPOT: per request, (E2E - TTFT) / (output tokens - 1).
- ITL: gaps between successive text chunks, pooled over all requests.
- output throughput: sum of the server-reported usage.completion_tokens / wall time.
- goodput: requests meeting every SLO given / wall time.

Load is either a closed loop (`--concurrency C`: C clients, each sends its next request when
the last one ends) or an open loop (`--request-rate R`: Poisson arrivals, R per second).
Prompts are the ShareGPT chat mix (benchmarks/bench_data.py); the output length is fixed with
`ignore_eos` so every system generates the same number of tokens, and each request's
usage.completion_tokens is checked against it (`token_mismatches` in the result).

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --concurrency 16 \\
        --num-prompts 64 --output-len 128 --result-json .bench/results/run.json

As a module: `summary = run(BenchConfig(...))` returns the summary dict that --result-json
writes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_data import ChatSample, load_chat_samples  # noqa: E402

PERCENTILES = (50, 90, 99)
MAX_ERROR_EXAMPLES = 5


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None -> the first id from GET /v1/models
    endpoint: str = "chat"  # "chat" (/v1/chat/completions) or "completions" (/v1/completions)
    num_prompts: int = 64
    concurrency: int | None = 16  # closed loop; None with request_rate set -> open loop
    request_rate: float | None = None  # Poisson arrivals per second (open loop)
    max_concurrency: int | None = None  # open loop: cap on requests in flight
    output_len: int = 128
    output_len_mode: str = "fixed"  # "fixed" or "sampled" (reply lengths, output_len the cap)
    ignore_eos: bool = True
    temperature: float = 0.0
    stream: bool = True
    seed: int = 0
    min_prompt_tokens: int = 4
    max_prompt_tokens: int = 1024
    system_prompt: str | None = None  # a shared prefix before every prompt
    num_warmup: int = 2
    warmup_output_len: int = 16
    max_duration_s: float | None = None  # stop sending new requests after this long
    request_timeout_s: float = 600.0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_e2e_ms: float | None = None
    show_progress: bool = True
    label: str | None = None  # free text copied into the result (system name, etc.)


@dataclass
class RequestResult:
    index: int
    expected_output_tokens: int
    is_success: bool = False
    error: str | None = None
    status: int | None = None
    start_s: float = 0.0  # relative to the benchmark start
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)
    num_chunks: int = 0
    num_output_tokens: int | None = None  # from usage; None when the server sent none
    num_prompt_tokens: int | None = None
    finish_reason: str | None = None
    text_len: int = 0

    @property
    def tpot_s(self) -> float | None:
        n = self.num_output_tokens
        if self.e2e_s is None or self.ttft_s is None or n is None or n < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (n - 1)


def build_body(cfg: BenchConfig, model: str, sample: ChatSample, max_tokens: int,
               prompt_text: str | None) -> dict:
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": cfg.temperature,
                  "stream": cfg.stream}
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    if cfg.ignore_eos:
        # vLLM, llama-server and zeroserve all read `ignore_eos`; the usage check below
        # catches a server that silently ignores it.
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        messages = list(sample.messages)
        if cfg.system_prompt:
            messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
        body["messages"] = messages
    else:
        body["prompt"] = prompt_text
    return body


async def send_request(session: aiohttp.ClientSession, url: str, body: dict,
                       result: RequestResult, t0: float) -> RequestResult:
    """Send one request and time it; never raises (failures land in result.error)."""
    start = time.perf_counter()
    result.start_s = start - t0
    last_chunk: float | None = None
    try:
        async with session.post(url, json=body) as resp:
            result.status = resp.status
            if resp.status != 200:
                text = (await resp.text())[:300]
                result.error = f"HTTP {resp.status}: {text}"
                result.e2e_s = time.perf_counter() - start
                return result
            if not body.get("stream"):
                data = await resp.json(content_type=None)
                now = time.perf_counter()
                result.ttft_s = result.e2e_s = now - start
                _take_choice(result, (data.get("choices") or [{}])[0], body)
                _take_usage(result, data.get("usage"))
                result.num_chunks = 1
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    now = time.perf_counter()
                    event = json.loads(payload)
                    if "error" in event:
                        raise RuntimeError(f"stream error: {str(event['error'])[:200]}")
                    _take_usage(result, event.get("usage"))
                    for choice in event.get("choices") or []:
                        if _take_choice(result, choice, body):
                            if result.ttft_s is None:
                                result.ttft_s = now - start
                            else:
                                result.chunk_gaps_s.append(now - last_chunk)
                            last_chunk = now
                            result.num_chunks += 1
                result.e2e_s = time.perf_counter() - start
            if result.ttft_s is None:
                result.error = "no text in the response"
                return result
            result.is_success = True
    except TimeoutError:
        result.error = "timeout"
    except (aiohttp.ClientError, RuntimeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    if result.e2e_s is None:
        result.e2e_s = time.perf_counter() - start
    return result


def _take_choice(result: RequestResult, choice: dict, body: dict) -> bool:
    """Record a choice's text and finish reason; True if it carried text."""
    if choice.get("finish_reason"):
        result.finish_reason = choice["finish_reason"]
    if "messages" in body:
        part = choice.get("delta") or choice.get("message") or {}
        text = part.get("content") or ""
    else:
        text = choice.get("text") or ""
    result.text_len += len(text)
    return bool(text)


def _take_usage(result: RequestResult, usage: dict | None) -> None:
    if usage:
        result.num_output_tokens = usage.get("completion_tokens")
        result.num_prompt_tokens = usage.get("prompt_tokens")


async def fetch_model_id(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as resp:
        resp.raise_for_status()
        data = await resp.json(content_type=None)
    return data["data"][0]["id"]


def _prompt_texts(cfg: BenchConfig, samples: list[ChatSample]) -> list[str | None]:
    """For /v1/completions: the chat template applied here, so both endpoints see one text."""
    if cfg.endpoint == "chat":
        return [None] * len(samples)
    from benchmarks.bench_data import load_tokenizer

    tok = load_tokenizer()
    out = []
    for s in samples:
        msgs = list(s.messages)
        if cfg.system_prompt:
            msgs = [{"role": "system", "content": cfg.system_prompt}, *msgs]
        out.append(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    return out


async def run_async(cfg: BenchConfig, samples: list[ChatSample] | None = None) -> dict:
    if cfg.concurrency is None and cfg.request_rate is None:
        raise ValueError("set concurrency (closed loop) or request_rate (open loop)")
    if samples is None:
        samples = load_chat_samples(cfg.num_prompts, cfg.seed, cfg.min_prompt_tokens,
                                    cfg.max_prompt_tokens)
    prompt_texts = _prompt_texts(cfg, samples)
    base = cfg.base_url.rstrip("/")
    url = f"{base}/v1/chat/completions" if cfg.endpoint == "chat" else f"{base}/v1/completions"
    limit = max(cfg.concurrency or 0, cfg.max_concurrency or 0, 64) + 8
    # A fresh connection per request: llama-server closes kept-alive connections that aiohttp
    # would otherwise reuse and fail on ("Can not write request body"). Connecting over
    # loopback costs well under a millisecond.
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, force_close=True)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = cfg.model or await fetch_model_id(session, base)

        def body_for(i: int, max_tokens: int | None = None) -> tuple[dict, int]:
            s = samples[i % len(samples)]
            # sampled: the dataset reply's length, with --output-len as the cap.
            n = max_tokens or (cfg.output_len if cfg.output_len_mode == "fixed"
                               else min(s.num_reference_output_tokens, cfg.output_len))
            return build_body(cfg, model, s, n, prompt_texts[i % len(samples)]), n

        warmup_errors = []
        for i in range(cfg.num_warmup):
            # Prompts outside the measured set, so no measured request hits a prefix cache
            # the warmup filled.
            warm = ChatSample([{"role": "user", "content": f"Warm-up {i}: count to {i + 3}."}],
                              8, cfg.warmup_output_len)
            text = _prompt_texts(cfg, [warm])[0]
            body = build_body(cfg, model, warm, cfg.warmup_output_len, text)
            r = await send_request(session, url, body, RequestResult(-1, cfg.warmup_output_len),
                                   time.perf_counter())
            if not r.is_success:
                warmup_errors.append(r.error)
        if cfg.num_warmup and len(warmup_errors) == cfg.num_warmup:
            raise RuntimeError(f"every warmup request failed: {warmup_errors[0]}")

        results: list[RequestResult] = []
        progress = _progress(cfg)
        t0 = time.perf_counter()
        deadline = t0 + cfg.max_duration_s if cfg.max_duration_s else math.inf

        async def one(i: int) -> None:
            body, n = body_for(i)
            r = await send_request(session, url, body, RequestResult(i, n), t0)
            results.append(r)
            if progress is not None:
                progress.update(1)

        if cfg.request_rate is None:
            next_index = iter(range(cfg.num_prompts))

            async def client() -> None:
                for i in next_index:
                    if time.perf_counter() >= deadline:
                        return
                    await one(i)

            await asyncio.gather(*(client() for _ in range(cfg.concurrency)))
        else:
            rng = random.Random(cfg.seed)
            gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

            async def gated(i: int) -> None:
                if gate is None:
                    await one(i)
                else:
                    async with gate:
                        await one(i)

            tasks = []
            for i in range(cfg.num_prompts):
                if time.perf_counter() >= deadline:
                    break
                tasks.append(asyncio.create_task(gated(i)))
                if cfg.request_rate != math.inf:
                    await asyncio.sleep(rng.expovariate(cfg.request_rate))
            await asyncio.gather(*tasks)
        wall_s = time.perf_counter() - t0
        if progress is not None:
            progress.close()
    summary = summarize(cfg, model, results, wall_s)
    summary["warmup_errors"] = warmup_errors
    return summary


def _progress(cfg: BenchConfig):
    if not cfg.show_progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=cfg.num_prompts, desc=cfg.label or "requests", leave=False)


def percentile_stats(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean and p50/p90/p99 (linear interpolation, as numpy), in ms by default."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    xs = sorted(values)
    out = {"mean": sum(xs) / len(xs) * scale}
    for p in PERCENTILES:
        k = (len(xs) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        out[f"p{p}"] = (xs[lo] + (xs[hi] - xs[lo]) * (k - lo)) * scale
    return out


def meets_slo(cfg: BenchConfig, r: RequestResult) -> bool:
    if not r.is_success:
        return False
    if cfg.slo_ttft_ms is not None and r.ttft_s * 1000 > cfg.slo_ttft_ms:
        return False
    if cfg.slo_e2e_ms is not None and r.e2e_s * 1000 > cfg.slo_e2e_ms:
        return False
    tpot = r.tpot_s
    return not (cfg.slo_tpot_ms is not None and tpot is not None and tpot * 1000 > cfg.slo_tpot_ms)


def summarize(cfg: BenchConfig, model: str, results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.is_success]
    failed = [r for r in results if not r.is_success]
    usage_missing = [r for r in ok if r.num_output_tokens is None]
    # Without usage, fall back to counting text chunks (a lower bound if chunks hold several
    # tokens); the result says how many requests needed it.
    out_tokens = [r.num_output_tokens if r.num_output_tokens is not None else r.num_chunks
                  for r in ok]
    mismatched = [r for r in ok if cfg.ignore_eos and r.num_output_tokens is not None
                  and r.num_output_tokens != r.expected_output_tokens]
    total_out = sum(out_tokens)
    total_in = sum(r.num_prompt_tokens or 0 for r in ok)
    has_slo = any(x is not None for x in (cfg.slo_ttft_ms, cfg.slo_tpot_ms, cfg.slo_e2e_ms))
    errors: list[str] = []
    for r in failed:
        if r.error not in errors and len(errors) < MAX_ERROR_EXAMPLES:
            errors.append(r.error)
    itls = [g for r in ok for g in r.chunk_gaps_s]
    return {
        "label": cfg.label,
        "config": asdict(cfg),
        "model": model,
        "mode": "closed" if cfg.request_rate is None else "open",
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "error_examples": errors,
        "token_mismatches": len(mismatched),
        "token_mismatch_examples": [
            {"expected": r.expected_output_tokens, "got": r.num_output_tokens,
             "finish_reason": r.finish_reason} for r in mismatched[:MAX_ERROR_EXAMPLES]],
        "usage_missing": len(usage_missing),
        "duration_s": wall_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_throughput": total_out / wall_s if wall_s > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / wall_s if wall_s > 0 else 0.0,
        "goodput": (sum(meets_slo(cfg, r) for r in ok) / wall_s) if has_slo and wall_s > 0 else None,
        "mean_chunk_tokens": (total_out / sum(r.num_chunks for r in ok)) if ok and sum(r.num_chunks for r in ok) else None,
        "ttft_ms": percentile_stats([r.ttft_s for r in ok]),
        "tpot_ms": percentile_stats([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": percentile_stats(itls),
        "e2e_ms": percentile_stats([r.e2e_s for r in ok]),
        "requests": [
            {"index": r.index, "ok": r.is_success, "start_s": r.start_s, "ttft_s": r.ttft_s,
             "e2e_s": r.e2e_s, "tpot_s": r.tpot_s, "output_tokens": r.num_output_tokens,
             "prompt_tokens": r.num_prompt_tokens, "chunks": r.num_chunks, "error": r.error}
            for r in sorted(results, key=lambda r: r.index)],
        "itl_samples_ms": [g * 1000 for g in itls],
    }


def run(cfg: BenchConfig, samples: list[ChatSample] | None = None) -> dict:
    # The load generator shares the machine with the server it measures: uvloop (installed
    # with uvicorn[standard]) cuts its CPU per streamed chunk, which it would otherwise
    # take from the server. The same client runs against every system.
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run_async(cfg, samples))
    return uvloop.run(run_async(cfg, samples))


def format_summary(s: dict) -> str:
    def f(x, nd=1):
        return "-" if x is None else f"{x:.{nd}f}"

    load = (f"concurrency {s['config']['concurrency']}" if s["mode"] == "closed"
            else f"rate {s['config']['request_rate']}/s")
    lines = [
        f"== {s['label'] or s['model']} ({load}) ==",
        f"requests: {s['completed']} ok, {s['failed']} failed, "
        f"{s['token_mismatches']} token-count mismatches, {s['usage_missing']} without usage",
        f"duration {f(s['duration_s'], 2)} s; input {s['total_input_tokens']} tok, "
        f"output {s['total_output_tokens']} tok",
        f"request throughput {f(s['request_throughput'], 2)} req/s; "
        f"output throughput {f(s['output_throughput'])} tok/s"
        + (f"; goodput {f(s['goodput'], 2)} req/s" if s["goodput"] is not None else ""),
        f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        st = s[key]
        lines.append(f"{key[:-3].upper():<12}" + "".join(
            f"{f(st[k]):>10}" for k in ("mean", "p50", "p90", "p99")))
    for e in s["error_examples"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, argparse.Namespace]:
    d = BenchConfig()
    ap = argparse.ArgumentParser(description=(
        "Benchmark an OpenAI-compatible server: TTFT, ITL, TPOT, E2E latency, output tokens/s "
        "and goodput (vLLM's definitions) over the ShareGPT chat mix, closed or open loop."))
    ap.add_argument("--base-url", default=d.base_url)
    ap.add_argument("--model", default=None, help="default: the first id from /v1/models")
    ap.add_argument("--endpoint", choices=["chat", "completions"], default=d.endpoint)
    ap.add_argument("--num-prompts", type=int, default=d.num_prompts)
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None,
                      help=f"closed loop with this many clients (default {d.concurrency})")
    load.add_argument("--request-rate", type=float, default=None,
                      help="open loop: Poisson arrivals per second (inf: all at once)")
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help="open loop: cap on requests in flight")
    ap.add_argument("--output-len", type=int, default=d.output_len)
    ap.add_argument("--output-len-mode", choices=["fixed", "sampled"], default=d.output_len_mode)
    ap.add_argument("--no-ignore-eos", action="store_true")
    ap.add_argument("--temperature", type=float, default=d.temperature)
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--min-prompt-tokens", type=int, default=d.min_prompt_tokens)
    ap.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    ap.add_argument("--system-prompt-file", type=Path, default=None,
                    help="a shared system prompt before every request (prefix caching)")
    ap.add_argument("--num-warmup", type=int, default=d.num_warmup)
    ap.add_argument("--max-duration-s", type=float, default=None)
    ap.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--slo-e2e-ms", type=float, default=None)
    ap.add_argument("--label", default=None)
    ap.add_argument("--result-json", type=Path, default=None)
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    cfg = replace(
        d, base_url=a.base_url, model=a.model, endpoint=a.endpoint, num_prompts=a.num_prompts,
        concurrency=None if a.request_rate is not None else (a.concurrency or d.concurrency),
        request_rate=a.request_rate, max_concurrency=a.max_concurrency,
        output_len=a.output_len, output_len_mode=a.output_len_mode,
        ignore_eos=not a.no_ignore_eos, temperature=a.temperature, stream=not a.no_stream,
        seed=a.seed, min_prompt_tokens=a.min_prompt_tokens, max_prompt_tokens=a.max_prompt_tokens,
        system_prompt=a.system_prompt_file.read_text() if a.system_prompt_file else None,
        num_warmup=a.num_warmup, max_duration_s=a.max_duration_s,
        request_timeout_s=a.request_timeout_s, slo_ttft_ms=a.slo_ttft_ms,
        slo_tpot_ms=a.slo_tpot_ms, slo_e2e_ms=a.slo_e2e_ms, label=a.label,
        show_progress=not a.no_progress,
    )
    return cfg, a


def main(argv: list[str] | None = None) -> int:
    cfg, a = parse_args(argv)
    summary = run(cfg)
    print(format_summary(summary))
    if a.result_json:
        a.result_json.parent.mkdir(parents=True, exist_ok=True)
        a.result_json.write_text(json.dumps(summary, indent=1))
        print(f"wrote {a.result_json}")
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
