"""SSEResponse's slow-client rules with a fake ASGI send: a stalled send, a trickle reader
under the minimum rate, and the readers and streams that must be left alone."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from zeroserve.gateway.http.sse import SSEResponse

TIMEOUT_S = 0.4  # the window; checks every 0.1 s
# "Aborted at the timeout", with room for a loaded machine's late timers: a stream that is
# never aborted runs 10 s (run_stream's wait_for) or more.
ABORTED_WITHIN_S = 5.0
ERROR_EVENT = b"data: {\"error\": \"too slow\"}\n\n"


@dataclass
class Run:
    sent: list[bytes] = field(default_factory=list)
    final: bytes | None = None
    cleaned_up: bool = False
    response: SSEResponse | None = None
    elapsed_s: float = 0.0


def run_stream(num_chunks: int, chunk_size: int, send_delay_s: float | None,
               produce_delay_s: float = 0.0, min_client_rate: float = 2000.0) -> Run:
    """Stream `num_chunks` chunks; each send takes `send_delay_s` (None: blocks forever)."""
    run = Run()

    async def events():
        try:
            for _ in range(num_chunks):
                if produce_delay_s:
                    await asyncio.sleep(produce_delay_s)
                yield b"x" * chunk_size
        finally:
            run.cleaned_up = True  # where the real source aborts its engine requests

    async def send(message: dict) -> None:
        if message["type"] != "http.response.body":
            return
        if not message["more_body"]:
            run.final = message["body"]
            return
        if send_delay_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(send_delay_s)
        run.sent.append(message["body"])

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client never disconnects
        return {}

    async def main() -> None:
        run.response = SSEResponse(events(), TIMEOUT_S, on_slow_client=lambda: ERROR_EVENT,
                                   min_client_rate=min_client_rate)
        started = time.monotonic()
        await asyncio.wait_for(run.response({}, receive, send), 10)
        run.elapsed_s = time.monotonic() - started

    asyncio.run(main())
    return run


def test_a_trickle_reader_under_the_rate_is_aborted():
    # 100 bytes every 0.1 s = 1 kB/s, blocked all the time; no single send lasts the timeout.
    run = run_stream(num_chunks=1000, chunk_size=100, send_delay_s=0.1)
    assert run.response.is_slow_client and run.response.slow_client_reason == "too slow"
    assert run.final == ERROR_EVENT and run.cleaned_up
    assert TIMEOUT_S <= run.elapsed_s < ABORTED_WITHIN_S
    assert len(run.sent) < 20


def test_a_slow_reader_above_the_rate_finishes():
    # 1000 bytes every 0.1 s = 10 kB/s: slower than generation (client-bound), above the rate.
    run = run_stream(num_chunks=15, chunk_size=1000, send_delay_s=0.1)
    assert not run.response.is_slow_client
    assert len(run.sent) == 15 and run.final == b""


def test_slow_generation_is_not_the_clients_fault():
    # 10 bytes every 0.1 s = 100 B/s, far under the rate, but the sends never block.
    run = run_stream(num_chunks=12, chunk_size=10, send_delay_s=0.0, produce_delay_s=0.1)
    assert not run.response.is_slow_client and len(run.sent) == 12


def test_a_stalled_send_is_aborted_at_the_timeout():
    run = run_stream(num_chunks=100, chunk_size=100, send_delay_s=None, min_client_rate=0)
    assert run.response.slow_client_reason == "stalled"
    assert TIMEOUT_S <= run.elapsed_s < ABORTED_WITHIN_S
    assert run.final == ERROR_EVENT and run.cleaned_up


def test_rate_zero_keeps_only_the_stalled_rule():
    run = run_stream(num_chunks=12, chunk_size=100, send_delay_s=0.1, min_client_rate=0)
    assert not run.response.is_slow_client and len(run.sent) == 12
