#!/usr/bin/env python3
"""Soak a real server with mixed clients and sample its workers' resident memory (RSS).

    .venv/bin/python benchmarks/soak_rss.py --minutes 5 --workers 2 --clients 8 \
        --out /tmp/soak.jsonl

Starts `zeroserve serve` (or uses --url of one already running), then runs --clients
clients for --minutes. Each client loops over a mix of what real traffic holds: streamed
chat, plain completions, a stream the client drops half way, n=2, JSON mode, a tool call
and a malformed request. Every --interval seconds it reads each worker's pid from
GET /admin/workers (loopback, keyless) and its VmRSS from /proc, and prints one line per
sample (also written as JSON lines to --out). At the end: each worker's first, last and
largest RSS, the growth over the second half of the run, and the requests' outcomes.

A worker whose RSS keeps rising while the load is steady touches more memory than its
working set needs (issue 35, item 17: the KV pool handed out first-in-first-out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import httpx

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "List ten uses for a paperclip.",
    "Explain how a bicycle stays upright.",
    "What is the capital of France? Answer in one word.",
    "Describe the water cycle for a child.",
    "Give three tips for writing clean Python code.",
    "Translate 'good morning' into five languages.",
    "Summarise the plot of a detective novel you invent.",
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def worker_pids(client: httpx.AsyncClient) -> dict[str, int]:
    try:
        r = await client.get("/admin/workers", timeout=10,
                             headers={"X-Zeroserve-Admin": "1"})  # not a web page
        body = r.json()
    except (httpx.HTTPError, ValueError):
        return {}
    workers = body.get("workers", body) if isinstance(body, dict) else body
    return {w["worker_id"]: w["pid"] for w in workers
            if isinstance(w, dict) and "pid" in w}


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random) -> str:
    prompt = rng.choice(PROMPTS) + f" (variant {rng.randrange(10_000)})"
    messages = [{"role": "user", "content": prompt}]
    max_tokens = rng.randrange(16, 160)
    if kind == "stream":
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_lines():
                pass
            return str(r.status_code)
    if kind == "disconnect":
        body = {"model": MODEL, "messages": messages, "max_tokens": 200, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            n = 0
            async for _ in r.aiter_lines():
                n += 1
                if n > 8:
                    break  # the client goes away mid-stream
            return "dropped"
    if kind == "completion":
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
        r = await client.post("/v1/completions", json=body)
        return str(r.status_code)
    if kind == "n2":
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "n": 2,
                "temperature": 0.8}
        r = await client.post("/v1/chat/completions", json=body)
        return str(r.status_code)
    if kind == "json":
        body = {"model": MODEL, "max_tokens": 64,
                "messages": [{"role": "user", "content": "Reply with a JSON object: " + prompt}],
                "response_format": {"type": "json_object"}}
        r = await client.post("/v1/chat/completions", json=body)
        return str(r.status_code)
    if kind == "tools":
        body = {"model": MODEL, "max_tokens": 64, "tools": TOOLS, "tool_choice": "required",
                "messages": [{"role": "user", "content": "Weather in Paris?"}]}
        r = await client.post("/v1/chat/completions", json=body)
        return str(r.status_code)
    # bad input: the server must answer 4xx and go on
    r = await client.post("/v1/chat/completions",
                          json={"model": MODEL, "messages": "not a list", "max_tokens": -1})
    return str(r.status_code)


MODEL = "default"  # set from GET /v1/models once the server is up

KINDS = ["stream", "stream", "completion", "disconnect", "n2", "json", "tools", "bad"]


async def client_loop(url: str, deadline: float, seed: int, outcomes: Counter) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            kind = rng.choice(KINDS)
            try:
                outcome = await one_request(client, kind, rng)
            except httpx.HTTPError as e:
                outcome = type(e).__name__
            outcomes[f"{kind}:{outcome}"] += 1


async def sampler(url: str, deadline: float, interval: float, samples: list[dict],
                  out_path: str | None) -> None:
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url) as client:
        while True:
            pids = await worker_pids(client)
            row = {"t_s": round(time.monotonic() - start, 1),
                   "rss_mb": {wid: round((rss_bytes(pid) or 0) / 2**20, 1)
                              for wid, pid in sorted(pids.items())}}
            samples.append(row)
            print(json.dumps(row), flush=True)
            if out_path:
                with open(out_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))


def summarise(samples: list[dict]) -> dict:
    per_worker: dict[str, list[tuple[float, float]]] = {}
    for row in samples:
        for wid, mb in row["rss_mb"].items():
            if mb:
                per_worker.setdefault(wid, []).append((row["t_s"], mb))
    summary = {}
    for wid, series in per_worker.items():
        half = series[len(series) // 2:]
        summary[wid] = {"first_mb": series[0][1], "last_mb": series[-1][1],
                        "max_mb": max(mb for _, mb in series),
                        "second_half_growth_mb": round(half[-1][1] - half[0][1], 1)}
    return summary


async def wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url) as client:
        while time.monotonic() < deadline:
            try:
                r = await client.get("/health", timeout=5)
                if r.status_code == 200 and await worker_pids(client):
                    global MODEL
                    MODEL = (await client.get("/v1/models")).json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)
    raise SystemExit(f"the server at {url} did not get ready in {timeout_s:.0f}s")


async def soak(args: argparse.Namespace) -> dict:
    await wait_ready(args.url, args.ready_timeout)
    deadline = time.monotonic() + args.minutes * 60
    outcomes: Counter = Counter()
    samples: list[dict] = []
    clients = [asyncio.create_task(client_loop(args.url, deadline, k, outcomes))
               for k in range(args.clients)]
    await sampler(args.url, deadline, args.interval, samples, args.out)
    await asyncio.gather(*clients, return_exceptions=True)
    await asyncio.sleep(2.0)  # what the last requests held is freed
    await sampler(args.url, 0, 0, samples, args.out)  # one sample at rest
    return {"rss": summarise(samples), "outcomes": dict(sorted(outcomes.items()))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--interval", type=float, default=15.0, help="seconds between samples")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--port", type=int, default=8731)
    p.add_argument("--url", help="a running server (default: start one)")
    p.add_argument("--out", help="also write the samples here, as JSON lines")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("serve_args", nargs="*", help="more `zeroserve serve` arguments (after --)")
    args = p.parse_args()
    server = None
    if args.url is None:
        args.url = f"http://127.0.0.1:{args.port}"
        exe = os.path.join(os.path.dirname(sys.executable), "zeroserve")
        server = subprocess.Popen([exe, "serve", "--port", str(args.port),
                                   "--workers", str(args.workers), *args.serve_args],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
    try:
        result = asyncio.run(soak(args))
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
