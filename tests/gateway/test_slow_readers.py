"""The minimum-rate rule on a real server with small socket buffers (so that a reader's
blocked writes complete within the timeout, and only the rate can tell it is too slow)."""

from __future__ import annotations

import logging
import time

import pytest

from tests.e2e.trickle import TrickleClient
from tests.gateway.helpers import GatewayServer, cyclic_reply, raw_completion, wait_until

pytestmark = pytest.mark.slow

BODY = {"prompt": "x", "max_tokens": 4000}  # within the server's max_tokens cap


def reasons(caplog) -> list[str]:
    return [r.reason for r in caplog.records if r.getMessage().startswith("slow client")]


@pytest.mark.parametrize("num_bytes,is_aborted", [
    (1024, True),  # ~10 kB/s: under the 20 kB/s minimum
    (8192, False),  # ~80 kB/s: slower than generation, above the minimum
])
def test_the_rate_decides(caplog, num_bytes, is_aborted):
    caplog.set_level(logging.WARNING, logger="zeroserve.gateway.http.sse")
    with GatewayServer(credit_window=16, slow_client_timeout_s=1.0,
                       min_client_rate=20_000) as gw:
        worker = gw.worker(reply=cyclic_reply("x" * 50), step_s=0.001).start()
        assert worker.ready.wait(5)
        client = TrickleClient(gw.port, "/v1/completions", BODY, num_bytes, every_s=0.1)
        try:
            rid = gw.shrink_the_stream(worker)
            if is_aborted:
                assert wait_until(lambda: rid in worker.aborts, 10)
                assert reasons(caplog) == ["too slow"]  # never one write blocked for 1 s
            else:
                time.sleep(5)  # five windows
                assert rid not in worker.aborts and reasons(caplog) == []
                assert len(client.received) > 5 * 20_000
        finally:
            client.close()
            worker.stop()


@pytest.mark.parametrize("send_buffer,is_aborted", [
    (64 * 1024, True),  # the product's default: bounded, so the stream stops and is aborted
    (0, False),  # the kernel's autotuning: megabytes, all 4000 tokens fit in the socket
])
def test_a_client_that_stops_reading_is_stopped_by_the_bounded_send_buffer(send_buffer,
                                                                           is_aborted):
    # Nothing shrinks the buffers by hand here: the gateway's own socket settings must make
    # a client that never reads (a tiny receive buffer of its own) block its stream.
    with GatewayServer(credit_window=16, slow_client_timeout_s=1.0,
                       client_send_buffer_bytes=send_buffer) as gw:
        worker = gw.worker(reply=cyclic_reply("x" * 50), step_s=0.001).start()
        assert worker.ready.wait(5)
        sock = raw_completion(gw.port, {**BODY, "stream": True}, rcvbuf=4096)
        try:
            assert wait_until(lambda: worker.submits, 5)
            rid = worker.submits[0].request_id
            if is_aborted:
                assert wait_until(lambda: rid in worker.aborts, 8)
            else:  # every token generated and handed to the socket: nothing left to abort
                assert wait_until(lambda: worker.num_sent.get(rid) == BODY["max_tokens"]
                                  and not gw.gateway.streams, 30)
                assert rid not in worker.aborts
        finally:
            sock.close()
            worker.stop()
