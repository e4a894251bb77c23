"""Slow readers cost bounded resources, end to end (real processes and sockets, fake backend).

A client that reads, but only a few bytes at a time (a trickle), is aborted and its KV blocks
come back, while a normal stream beside it finishes intact. Which rule catches it here
depends on the kernel's buffers: with megabytes queued on loopback, one blocked write
outlasts the timeout first. tests/gateway/test_slow_readers.py shrinks the buffers to show
the minimum-rate rule catching a reader whose writes do complete.
"""

from __future__ import annotations

import pytest

from tests.e2e.helpers import MODEL, is_idle, stream_completion
from tests.e2e.trickle import TrickleClient

pytestmark = pytest.mark.slow

SLOW_CLIENT_TIMEOUT_S = 2.0
MIN_CLIENT_RATE = 4096  # bytes/s


@pytest.fixture(scope="module")
def server(module_servers):
    return module_servers(args=(
        "--backend", "fake", "--device", "cpu", "--num-kv-blocks", "4096",
        "--max-model-len", "60000", "--fake-forward-ms", "1",
        "--slow-client-timeout", str(SLOW_CLIENT_TIMEOUT_S),
        "--min-client-rate", str(MIN_CLIENT_RATE),
    ))


def test_a_trickle_reader_is_aborted_while_a_normal_stream_finishes(server):
    server.wait_for(is_idle, timeout_s=5, what="idle before the test")
    body = {"prompt": "Count to a million.", "max_tokens": 300}
    alone = stream_completion(server.url, body)
    assert alone.finish_reason == "length"

    # Big chunks (20 logprobs a token) fill the buffers between us and the server fast.
    trickle = TrickleClient(server.port, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4000, "logprobs": True, "top_logprobs": 20,
        "messages": [{"role": "user", "content": "Say a lot."}]},
        num_bytes=16, every_s=0.1)  # 160 bytes/s
    try:
        server.wait_for(lambda ws: not is_idle(ws), timeout_s=5, what="the trickle started")
        beside = stream_completion(server.url, body)
        assert beside.finish_reason == "length" and beside.text == alone.text
        assert beside.error is None and beside.is_done

        # Aborted and its blocks freed: within a window or two once the buffers are full.
        server.wait_for(is_idle, timeout_s=6 * SLOW_CLIENT_TIMEOUT_S + 10,
                        what="the trickle aborted")
        tail = trickle.drain()
        # It never reads like a finished stream: the error event (if the final write got
        # through), never a bare [DONE].
        assert b'"error"' in tail[-3000:] or b"[DONE]" not in tail[-3000:]
    finally:
        trickle.close()
