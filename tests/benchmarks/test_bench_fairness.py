"""The fairness benchmark's phases against an in-test server that notes who asked when."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from argparse import Namespace

import pytest

pytest.importorskip("aiohttp")
uvicorn = pytest.importorskip("uvicorn")
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from benchmarks.bench_fairness import KEYS, run_phase  # noqa: E402
from zeroserve.cli.harness import free_port  # noqa: E402

ANSWER_S = 0.02  # each request's one token comes this long after it arrived


class NotingServer:
    """Streams one token per completion and notes (key, max_tokens, arrival) of each."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[str, int, float]] = []
        app = Starlette(routes=[Route("/v1/completions", self.completions, methods=["POST"])])
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> NotingServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)

    async def completions(self, request):
        arrived = time.monotonic()
        body = await request.json()
        key = request.headers["authorization"].removeprefix("Bearer ")
        self.arrivals.append((key, body["max_tokens"], arrived))

        async def events():
            await asyncio.sleep(ANSWER_S)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def bench_args(**kw) -> Namespace:
    base = dict(seconds=0.25, settle=0.4, rate=10.0, a_max_tokens=3, b_max_tokens=2)
    return Namespace(**(base | kw))


def test_the_measured_key_starts_once_the_busy_key_has_settled():
    """B's first request used to go out in the same millisecond as A's first 64, which the
    gateway takes tens of milliseconds to admit: with p99 the slowest of 80, that one sample
    was B's p99. Now B starts --settle seconds after A and still sends its --seconds' worth."""
    args = bench_args()
    flows = {"a": ("closed", 4, None), "b": ("open", args.rate)}
    with NotingServer() as server:
        started = time.monotonic()
        results = asyncio.run(run_phase(f"http://127.0.0.1:{server.port}", args, flows, None))
    # (The phase's warm-up request is B's too, with 4 tokens: not a measured one.)
    a_times = [t for key, _, t in server.arrivals if key == KEYS["a"]]
    b_times = [t for key, n, t in server.arrivals if key == KEYS["b"] and n == args.b_max_tokens]
    assert len(b_times) == len(results["b"].ttfts) == 3  # at 0, 0.1 and 0.2 s: 0.25 s at 10 a second
    assert len(a_times) > 4
    assert min(b_times) >= started + args.settle  # B's first went out a settle in ...
    assert sorted(a_times)[:4] < [min(b_times)] * 4  # ... after A's start-up burst
    assert max(a_times) >= min(b_times)  # and A kept going while B was measured


def test_without_busy_keys_there_is_nothing_to_settle():
    args = bench_args(settle=30.0)  # would time the test out if it were waited for
    with NotingServer() as server:
        started = time.monotonic()
        results = asyncio.run(run_phase(f"http://127.0.0.1:{server.port}", args,
                                        {"b": ("open", args.rate)}, None))
    assert len(results["b"].ttfts) == 3
    assert time.monotonic() - started < args.settle
