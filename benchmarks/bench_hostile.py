"""Hostile input beside 32 streams: does anyone else's stream notice?

Starts `zeroserve serve` on loopback, then alternates two phases of equal length:

- **quiet**: the measured load alone: `--concurrency` (32) closed-loop streaming completions
  of `--output-len` tokens (`ignore_eos`), each checked to end intact (a [DONE], no error
  event, finish_reason "length", usage.completion_tokens == output-len).
- **hostile**: the same measured load, and beside it loops (`--hostile-clients`,
  `--trickle-clients`, `--disconnect-clients`) sending a mix of bad requests: oversized bodies, JSON nested 100,000 deep, integers with hundreds of
  digits and beyond 64 bits, lone surrogates, prompts near the character limit, trickle
  readers (16 bytes every 0.1 s, hung up after `--trickle-s`) and clients that hang up after
  the first chunk. Every hostile request is counted with the status it got (5xx are listed:
  there should be none).

At each phase's end it reads `/health`'s `event_loop_lag` (the gateway's own monitor, a
sample every 50 ms over the last minute: a phase of >= 62 s has its window to itself) and
reports per phase: loop lag p50/p99/max and stalls, the measured streams' output tokens/s
and TTFT p50/p99, and how many ended intact.

    python benchmarks/bench_hostile.py --quick            # fake backend, 20 ms steps
    python benchmarks/bench_hostile.py                    # the default model on the CPU

Bounded: every phase ends at its deadline (requests in flight get `--drain-s` more), every
hostile kind has a count cap, everything is on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from zeroserve.cli.harness import start_server


@dataclass
class Phase:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    num_tokens: int = 0
    num_started: int = 0
    num_intact: int = 0
    failures: Counter = field(default_factory=Counter)
    hostile: dict[str, Counter] = field(default_factory=dict)
    wall_s: float = 0.0
    loop_lag: dict | None = None
    num_stalls: int = 0

    def summary(self) -> dict:
        ttft = sorted(self.ttft_s)
        return {
            "phase": self.name, "wall_s": round(self.wall_s, 1),
            "num_streams": self.num_started, "num_intact": self.num_intact,
            "failures": dict(self.failures),
            "output_tokens_per_s": round(self.num_tokens / self.wall_s, 1),
            "ttft_p50_ms": round(_pct(ttft, 0.5) * 1000, 1),
            "ttft_p99_ms": round(_pct(ttft, 0.99) * 1000, 1),
            "loop_lag": self.loop_lag, "num_stalls": self.num_stalls,
            "hostile": {kind: dict(c) for kind, c in self.hostile.items()},
        }


def _pct(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# -- the measured load -----------------------------------------------------------------------


async def measured_client(session: aiohttp.ClientSession, url: str, model: str,
                          output_len: int, deadline: float, phase: Phase) -> None:
    body = {"model": model, "prompt": "Write a long story about a lighthouse keeper.",
            "max_tokens": output_len, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    while time.monotonic() < deadline:
        phase.num_started += 1
        started = time.monotonic()
        ttft = None
        finish, usage, is_done, error = None, None, False, None
        try:
            async with session.post(url + "/v1/completions", json=body) as response:
                if response.status != 200:
                    phase.failures[f"http {response.status}"] += 1
                    continue
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        is_done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"].get("code") or event["error"].get("type")
                        continue
                    for choice in event.get("choices") or []:
                        if ttft is None and choice.get("text"):
                            ttft = time.monotonic() - started
                        finish = choice.get("finish_reason") or finish
                    usage = event.get("usage") or usage
        except (TimeoutError, aiohttp.ClientError) as e:
            phase.failures[type(e).__name__] += 1
            continue
        num = (usage or {}).get("completion_tokens", 0)
        phase.num_tokens += num
        if ttft is not None:
            phase.ttft_s.append(ttft)
        if is_done and error is None and finish == "length" and num == output_len:
            phase.num_intact += 1
        else:
            phase.failures[f"error {error}" if error else f"finish {finish} tokens {num}"] += 1


# -- the hostile mix -------------------------------------------------------------------------


def _request(path: str, body: bytes, content_type: str = "application/json") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def hostile_payloads(model: str, max_prompt_chars: int, oversize_mb: int) -> dict[str, bytes]:
    head = json.dumps({"model": model, "max_tokens": 4})[:-1]  # '{"model": ..., "max_tokens": 4'

    def completion(extra: str) -> bytes:
        return _request("/v1/completions", f"{head}, {extra}}}".encode())

    deep = "[" * 100_000 + "]" * 100_000
    big_digits = "9" * 400
    long_prompt = "word " * (max_prompt_chars // 5 - 10)
    return {
        "oversized_body": completion('"prompt": "%s"' % ("a" * (oversize_mb << 20))),
        "deep_json": completion(f'"prompt": {deep}'),
        "huge_int_float_field": completion(f'"prompt": "hi", "temperature": {big_digits}'),
        "int_beyond_64_bits": completion(f'"prompt": "hi", "top_k": {2 ** 64}, '
                                         f'"stop_token_ids": [{2 ** 64}]'),
        "lone_surrogate": _request("/v1/chat/completions", (
            head + ', "messages": [{"role": "user", "content": "a\\ud800b"}]}').encode()),
        "prompt_near_char_limit": completion(json.dumps({"prompt": long_prompt})[1:-1]),
        "tokenize_near_char_limit": _request("/tokenize", json.dumps(
            {"model": model, "prompt": long_prompt}).encode()),
    }


async def send_raw(port: int, payload: bytes, timeout_s: float) -> str:
    """Send a request, read the status line; 'reset' if the server cut us off first."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port), timeout_s)
    except (TimeoutError, OSError):
        return "connect failed"
    head, body = payload.split(b"\r\n\r\n", 1)
    try:
        # Headers first: a server that refuses by content-length (413) answers before the
        # body, and its answer would be lost to the reset if we were still writing.
        writer.write(head + b"\r\n\r\n")
        try:
            line = await asyncio.wait_for(reader.readline(), 0.2)
        except TimeoutError:
            writer.write(body)
            try:
                await asyncio.wait_for(writer.drain(), timeout_s)
            except (TimeoutError, ConnectionError):
                pass
            line = await asyncio.wait_for(reader.readline(), timeout_s)
        parts = line.split()
        return parts[1].decode() if len(parts) >= 2 else "no answer"
    except (TimeoutError, OSError):
        return "reset"
    finally:
        writer.close()


async def trickle(port: int, model: str, seconds: float) -> str:
    """A stream read 16 bytes every 0.1 s, hung up after `seconds`: how far it got."""
    body = json.dumps({"model": model, "prompt": "Say a lot.", "max_tokens": 4000,
                       "ignore_eos": True, "stream": True, "logprobs": 5}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, _request("/v1/completions", body))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                data = await asyncio.wait_for(loop.sock_recv(sock, 16), 0.5)
            except TimeoutError:
                continue
            if not data:
                return "closed by server"
            await asyncio.sleep(0.1)
        return "hung up"
    except OSError:
        return "reset"
    finally:
        sock.close()


async def hang_up_early(session: aiohttp.ClientSession, url: str, model: str) -> str:
    body = {"model": model, "prompt": "Tell me everything.", "max_tokens": 4000,
            "ignore_eos": True, "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                return str(response.status)
            async for raw in response.content:
                if raw.startswith(b"data: {"):
                    return "hung up"
        return "ended"
    except (TimeoutError, aiohttp.ClientError) as e:
        return type(e).__name__


async def hostile_client(k: int, session: aiohttp.ClientSession, url: str, port: int,
                         model: str, payloads: dict[str, bytes], args: argparse.Namespace,
                         deadline: float, phase: Phase) -> None:
    """Client k's loop: bad requests in turn (k < hostile_clients), else a trickle reader
    or a client that hangs up after the first chunk, over and over."""
    if k < args.hostile_clients:
        kinds = list(payloads)
    elif k < args.hostile_clients + args.trickle_clients:
        kinds = ["trickle_reader"]
    else:
        kinds = ["disconnect_after_first_chunk"]
    i = k
    while time.monotonic() < deadline:
        kind = kinds[i % len(kinds)]
        i += 1
        counts = phase.hostile.setdefault(kind, Counter())
        if sum(counts.values()) >= args.max_per_kind:
            if all(sum(phase.hostile.get(x, Counter()).values()) >= args.max_per_kind
                   for x in kinds):
                return
            continue
        if kind == "trickle_reader":
            outcome = await trickle(port, model, min(args.trickle_s, deadline - time.monotonic()))
        elif kind == "disconnect_after_first_chunk":
            outcome = await hang_up_early(session, url, model)
        else:
            outcome = await send_raw(port, payloads[kind], timeout_s=30)
        counts[outcome] += 1


# -- the run ---------------------------------------------------------------------------------


def health(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


async def run_phase(name: str, url: str, port: int, model: str, args: argparse.Namespace,
                    payloads: dict[str, bytes] | None) -> Phase:
    phase = Phase(name)
    stalls_before = health(url)["event_loop_lag"]["num_stalls"]
    timeout = aiohttp.ClientTimeout(total=args.duration + args.drain_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.monotonic()
        deadline = started + args.duration
        tasks = [measured_client(session, url, model, args.output_len, deadline, phase)
                 for _ in range(args.concurrency)]
        if payloads is not None:
            num = args.hostile_clients + args.trickle_clients + args.disconnect_clients
            tasks += [hostile_client(k, session, url, port, model, payloads, args, deadline,
                                     phase) for k in range(num)]
        await asyncio.gather(*tasks)
        phase.wall_s = time.monotonic() - started
    lag = await asyncio.to_thread(health, url)
    phase.loop_lag = lag["event_loop_lag"]
    phase.num_stalls = phase.loop_lag["num_stalls"] - stalls_before
    return phase


def serve_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The `zeroserve serve` flags of this run but --port."""
    flags = ["--device", "cpu", "--slow-client-timeout", str(args.slow_client_timeout),
             *args.server_args]
    if args.quick:
        flags += ["--backend", "fake", "--fake-forward-ms", "20", "--num-kv-blocks", "8192",
                  "--max-num-seqs", "64"]
    return tuple(flags)


def max_prompt_chars_default() -> int:
    from zeroserve.gateway.config import GatewayConfig

    return getattr(GatewayConfig(), "max_prompt_chars", 1_000_000)


def table(phases: list[Phase]) -> str:
    rows = ["| phase | loop lag p50 / p99 / max (ms) | stalls | output tok/s | TTFT p50 / p99 (ms) "
            "| intact / streams | hostile requests (5xx) |",
            "|---|---|---|---|---|---|---|"]
    for p in phases:
        s, lag = p.summary(), p.loop_lag
        num_hostile = sum(sum(c.values()) for c in p.hostile.values())
        num_5xx = sum(n for c in p.hostile.values() for k, n in c.items() if k.startswith("5"))
        rows.append(f"| {p.name} | {lag['p50_ms']:.1f} / {lag['p99_ms']:.1f} / "
                    f"{lag['max_ms']:.1f} | {p.num_stalls} | {s['output_tokens_per_s']:.0f} | "
                    f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} | "
                    f"{p.num_intact} / {p.num_started} | "
                    f"{num_hostile if p.hostile else '-'} ({num_5xx if p.hostile else '-'}) |")
    return "\n".join(rows)


async def main_async(args: argparse.Namespace, url: str) -> list[Phase]:
    model = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
    payloads = hostile_payloads(model, args.max_prompt_chars or max_prompt_chars_default(),
                                args.oversize_mb)
    phases = []
    for r in range(args.rounds):
        for name, mix in (("quiet", None), ("hostile", payloads)):
            phase = await run_phase(f"{name} {r + 1}", url, args.port, model, args, mix)
            print(json.dumps(phase.summary()), flush=True)
            phases.append(phase)
    return phases


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="the fake backend at 20 ms a step instead of the default model")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--duration", type=float, default=65.0, help="seconds per phase")
    p.add_argument("--rounds", type=int, default=2, help="quiet+hostile pairs, alternated")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--hostile-clients", type=int, default=4, help="loops of bad requests")
    p.add_argument("--trickle-clients", type=int, default=2)
    p.add_argument("--disconnect-clients", type=int, default=2)
    p.add_argument("--max-per-kind", type=int, default=500, help="per phase")
    p.add_argument("--trickle-s", type=float, default=6.0)
    p.add_argument("--oversize-mb", type=int, default=16)
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="[default: the gateway's own limit]")
    p.add_argument("--slow-client-timeout", type=float, default=5.0)
    p.add_argument("--drain-s", type=float, default=60.0)
    p.add_argument("--result-json", type=Path, default=None)
    p.add_argument("server_args", nargs="*", help="more `zeroserve serve` flags (after --)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_hostile-{args.port}.log"
    server = start_server(args=serve_args(args), port=args.port, log_path=log_path,
                          timeout_s=300)
    try:
        phases = asyncio.run(main_async(args, url))
    finally:
        server.stop(timeout_s=30)
    print(table(phases))
    quiet = [p for p in phases if p.name.startswith("quiet")]
    hostile = [p for p in phases if p.name.startswith("hostile")]
    ratio = (statistics.median(p.num_tokens / p.wall_s for p in hostile)
             / statistics.median(p.num_tokens / p.wall_s for p in quiet))
    print(f"hostile/quiet throughput (medians): {ratio:.3f}; server log: {log_path}")
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps({
            "argv": sys.argv, "phases": [p.summary() for p in phases],
            "hostile_over_quiet_throughput": ratio}, indent=1))
    all_intact = all(p.num_intact == p.num_started for p in phases)
    return 0 if all_intact else 1


if __name__ == "__main__":
    sys.exit(main())
