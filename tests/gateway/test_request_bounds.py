"""What one small request may cost the gateway: nothing left behind after a 400, bounded
work on the event loop, and the OpenAI behaviours that scoring clients rely on."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.helpers import GatewayServer, wait_until


@pytest.fixture
def served():
    """A gateway with one ready fake worker."""
    with GatewayServer() as gw:
        worker = gw.worker().start()
        assert worker.ready.wait(5)
        yield gw, worker
        worker.stop()


def assert_no_leaks(gw) -> None:
    assert wait_until(lambda: len(gw.gateway.streams) == 0, 3), gw.gateway.streams.states
    assert all(not w.request_ids for w in gw.gateway.registry.workers.values())


def test_a_later_prompt_too_long_leaves_no_request_state(served):
    gw, worker = served
    r = httpx.post(gw.url + "/v1/completions",
                   json={"prompt": ["short", "also short", "x" * 5000], "n": 3,
                         "max_tokens": 4})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert len(gw.gateway.streams) == 0, gw.gateway.streams.states  # not 6 orphans
    assert not worker.submits
    assert_no_leaks(gw)


@pytest.mark.parametrize(("stop", "what"), [
    ("x" * 257, "at most 256 characters"),
    (["y" * 200] * 6, "1024 characters together"),
])
def test_stop_strings_are_capped_with_a_clear_400(served, stop, what):
    gw, worker = served
    r = httpx.post(gw.url + "/v1/completions", json={"prompt": "hi", "stop": stop})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "stop" and what in error["message"]
    assert error["type"] == "invalid_request_error"
    assert not worker.submits


def test_stop_strings_at_the_caps_still_work(served):
    gw, _ = served
    r = httpx.post(gw.url + "/v1/completions",
                   json={"prompt": "hi", "stop": ["z" * 256, "q" * 256, ", world"]})
    assert r.status_code == 200
    assert r.json()["choices"][0] == {"index": 0, "text": "Hello", "logprobs": None,
                                      "finish_reason": "stop"}
