"""A streamed request leaves no reference cycles behind: its objects go when it ends, by
reference counting, not at the garbage collector's next pass. (In a burst of 1,000 requests
those passes were about a tenth of the gateway's CPU: issue 36.) Cycles that were found and
broken: the protocol's cycle and callback in the ASGI scope (gateway/http/http_protocol.py),
a streamed response and its SSEResponse (gateway/http/streaming.py), and the zmq.Again of
every drain of the receive loop kept in a future (gateway/workers/zmq_io.py)."""

from __future__ import annotations

import gc
import json

from tests.gateway.helpers import GatewayServer, cyclic_reply, one_shot, wait_until

NUM_REQUESTS = 20
# Left per request today: the asyncio selector transport's cycle with its own bound method
# (two objects; uvloop's transport, which `zeroserve gateway` uses, is not a Python object).
# Before the fixes: about 130.
MAX_GARBAGE_PER_REQUEST = 20


def streamed_completion(port: int) -> bytes:
    data = json.dumps({"prompt": "x", "max_tokens": 2, "stream": True}).encode()
    return one_shot(port, "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                          "Content-Type: application/json\r\n", data)


def test_streamed_requests_leave_no_reference_cycles(collector_off):
    with GatewayServer() as gw:
        worker = gw.worker(reply=cyclic_reply("ab")).start()
        try:
            assert worker.ready.wait(5)
            assert b"data: [DONE]" in streamed_completion(gw.port)  # warm up
            assert wait_until(lambda: len(gw.gateway.streams) == 0, 5)
            gc.collect()
            for _ in range(NUM_REQUESTS):
                assert b"data: [DONE]" in streamed_completion(gw.port)
            assert wait_until(lambda: len(gw.gateway.streams) == 0, 5)
            num_garbage = gc.collect()
        finally:
            worker.stop()
    assert num_garbage <= NUM_REQUESTS * MAX_GARBAGE_PER_REQUEST
