"""The gateway's CPU per streamed output, in-process and without sockets: the receive path
from a TOKENS message to the bytes of each stream's SSE chunk.

The relay benchmark (bench_gateway_relay.py) runs real processes on the same cores as its
load generator, so on this shared machine its CPU per token moves by 10-20% from run to
run. This one builds the real app (the default tokenizer, real request groups and streamed
responses, each parked on its sink as a live stream's would be), gives every response a
stand-in uvicorn cycle whose transport only counts bytes, and then times (CPU time of this
process) what the receive loop does with pre-encoded TOKENS messages: decoding, the
stream table, token checks, detokenizing, rendering the chunk, the (stand-in) write, credit.
The socket write itself, ~30% of the real gateway's CPU, is not in it.

    python scripts/bench_gateway_path.py --streams 1000 --steps 100 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class _Transport:
    def __init__(self) -> None:
        self.num_bytes = 0

    def write(self, data: bytes) -> None:
        self.num_bytes += len(data)

    def is_closing(self) -> bool:
        return False


def _cycle() -> types.SimpleNamespace:
    """What SSEResponse reads of uvicorn's RequestResponseCycle."""
    return types.SimpleNamespace(response_started=True, chunked_encoding=True,
                                 disconnected=False, transport=_Transport(),
                                 flow=types.SimpleNamespace(write_paused=False))


async def run_once(num_streams: int, num_steps: int, kind: str) -> dict:
    from zeroserve.common.protocol import PROTOCOL_VERSION, Hello, TokenOutput, Tokens, encode
    from zeroserve.gateway.api.openai_schema import parse_chat, parse_completion
    from zeroserve.gateway.api.responses import ResponseContext
    from zeroserve.gateway.app import build_app
    from zeroserve.gateway.config import GatewayConfig
    from zeroserve.gateway.generation import RequestGroup
    from zeroserve.gateway.http.http_protocol import CYCLE_SCOPE_KEY
    from zeroserve.gateway.http.streaming import StreamedResponse
    from zeroserve.gateway.streams import RequestPhase
    from zeroserve.gateway.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("default")
    app = build_app(GatewayConfig(port=1), tokenizer)
    gateway, api = app.state.gateway, app.state.api
    gateway.registry.register(Hello(PROTOCOL_VERSION, "w", "fake", 4096, 100_000, 16,
                                    num_streams, "cpu", 1), b"w-route", gateway.clock())
    words = tokenizer.encode(" the quick brown fox jumps over a lazy dog",
                             add_special_tokens=False)
    if kind == "chat":
        req = parse_chat({"model": api.served_names[0], "stream": True,
                          "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": num_steps + 10}, api.served_names, api.limits)
    else:
        req = parse_completion({"model": api.served_names[0], "prompt": "hi", "stream": True,
                                "max_tokens": num_steps + 10}, api.served_names, api.limits)
    params = req.sampling.worker_params(num_steps + 10, 0)

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        pass

    request_ids, cycles, tasks = [], [], []
    for _ in range(num_streams):
        group = RequestGroup(gateway)
        group.prompt_lengths.append(1)
        group.add([1], params, tokenizer, (), True)
        state = group.choices[0].state
        state.phase, state.worker_id, state.params = RequestPhase.RUNNING, "w", params
        state.credit_window = num_steps + 10  # no credit bookkeeping limits in the way
        streamed = StreamedResponse(gateway, tokenizer, group,
                                    ResponseContext(kind, api.served_names[0]), req.sampling)
        response = streamed.response(30.0, lambda: b"", 0.0, lambda: None)
        cycle = _cycle()
        tasks.append(asyncio.ensure_future(
            response({"type": "http", CYCLE_SCOPE_KEY: cycle}, receive, send)))
        request_ids.append(state.request_id)
        cycles.append(cycle)
    for _ in range(3):
        await asyncio.sleep(0)  # every response parks on its sink
    messages = []
    for step in range(num_steps):
        rows = [TokenOutput.wire_row(rid, [words[step % len(words)]], None, 1, step + 1)
                for rid in request_ids]
        messages.append([types.SimpleNamespace(bytes=f)
                         for f in encode(Tokens("w", step, rows))])
    dispatch = gateway.edge._dispatch_tokens
    cpu = []
    for frames in messages:
        t0 = time.process_time()
        dispatch(frames)
        await asyncio.sleep(0)  # what the step scheduled (credit) runs too
        cpu.append(time.process_time() - t0)
    num_bytes = sum(c.transport.num_bytes for c in cycles)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if num_bytes < num_streams * num_steps * 50:
        raise RuntimeError(f"only {num_bytes} bytes written: the direct path was not taken")
    per_output = statistics.median(cpu) / num_streams
    return {"us_per_output": round(per_output * 1e6, 2), "bytes": num_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kind", choices=["completion", "chat"], default="completion")
    args = ap.parse_args()
    from zeroserve.common.gc_tuning import tune_for_serving

    tune_for_serving()
    runs = [asyncio.run(run_once(args.streams, args.steps, args.kind))
            for _ in range(args.repeats)]
    us = sorted(r["us_per_output"] for r in runs)
    print(json.dumps({"streams": args.streams, "steps": args.steps, "kind": args.kind,
                      "us_per_output": us, "median": us[len(us) // 2]}))


if __name__ == "__main__":
    main()
