"""The gateway's HTTP protocol (gateway/http/http_protocol.py): a request answered by any
layer of the app, not only the completions routes, leaves no reference cycle behind. A
flood's 429s from the early shed (issue 39) each left their uvicorn cycle and scope for the
garbage collector, whose young collections then paused the gateway's loop ~20 ms every few
seconds, with the critical key's first tokens waiting behind them."""

from __future__ import annotations

import gc
import json

import pytest

from tests.gateway.helpers import GatewayServer, one_shot, wait_until
from tests.gateway.http.test_early_shed import post_in_background

pytestmark = pytest.mark.timeout(60)
BULK = "sk-bulk"
MODEL = "tiny"
NUM_REQUESTS = 20
# Left per request today: the asyncio selector transport of its connection (about 7 objects:
# the transport, its socket objects and a bound method; uvloop's transport, which `zeroserve
# gateway` uses, is not a Python object). Before the fix: about 27 (the uvicorn cycle, the
# scope and its headers, the protocol, ... as well).
MAX_GARBAGE_PER_REQUEST = 10


def garbage_of(requests: int, send) -> int:
    """Objects the collector finds after `requests` calls of `send` (one warm-up first)."""
    send()
    gc.collect()
    for _ in range(requests):
        send()
    return gc.collect()


def test_early_shed_refusals_and_router_answers_leave_no_reference_cycles(tmp_path,
                                                                          collector_off):
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({BULK: {"priority_class": "sheddable"}}))
    # One slot and no waiting room on the worker; the sheddable class may fill 1 of the 2
    # places in the gateway's queue: with both taken, the flood is refused from its headers.
    with GatewayServer(served_model_name=MODEL, api_keys=(BULK,), rate_limits_file=str(limits),
                       max_queued_requests=2, max_waiting_per_worker=0) as gw:
        worker = gw.worker(max_num_seqs=1).start()
        try:
            assert worker.ready.wait(5)
            worker.is_stepping = False  # the first request holds the slot
            post_in_background(gw, BULK)
            assert wait_until(lambda: len(worker.submits) == 1)
            post_in_background(gw, BULK)
            assert wait_until(lambda: gw.app.state.gateway.admission.num_queued == 1)
            body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()

            def refused() -> None:
                answer = one_shot(gw.port, "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                                  f"Authorization: Bearer {BULK}\r\n"
                                  "Content-Type: application/json\r\n", body)
                assert answer.startswith(b"HTTP/1.1 429"), answer[:200]

            def models() -> None:
                answer = one_shot(gw.port, "GET /v1/models HTTP/1.1\r\nHost: localhost\r\n"
                                  f"Authorization: Bearer {BULK}\r\n")
                assert answer.startswith(b"HTTP/1.1 200"), answer[:200]

            num_refused_garbage = garbage_of(NUM_REQUESTS, refused)
            num_models_garbage = garbage_of(NUM_REQUESTS, models)
        finally:
            worker.is_stepping = True
            worker.stop()
    assert num_refused_garbage <= NUM_REQUESTS * MAX_GARBAGE_PER_REQUEST
    assert num_models_garbage <= NUM_REQUESTS * MAX_GARBAGE_PER_REQUEST
