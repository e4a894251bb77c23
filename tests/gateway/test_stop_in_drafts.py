"""A stop string that ends inside a run of tokens a worker sends at once (accepted
speculative drafts: one output of several tokens) must end the choice where it would end
decoded token by token: usage, billing and logprobs count no token after the stop (issue 35,
item 5). On the gateway app with a fake worker over real sockets."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.helpers import GatewayServer, cyclic_reply

MODEL = "SmolLM2-135M-Instruct"


def served_completion(tokens_per_step: int, body: dict) -> dict:
    with GatewayServer() as gw:
        worker = gw.worker(tokens_per_step=tokens_per_step,
                           reply=cyclic_reply("one two three four ")).start()
        try:
            assert worker.ready.wait(5)
            r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, **body},
                           timeout=10)
            assert r.status_code == 200, r.text
            return r.json()
        finally:
            worker.stop()


@pytest.mark.parametrize("tokens_per_step", [4, 7, 16])
def test_usage_and_logprobs_end_at_the_stop_as_without_speculation(tokens_per_step):
    body = {"prompt": "count", "max_tokens": 60, "stop": ["three"], "logprobs": 1}
    plain = served_completion(1, body)
    drafted = served_completion(tokens_per_step, body)
    assert drafted["choices"][0]["text"] == plain["choices"][0]["text"] == "one two "
    assert drafted["choices"][0]["finish_reason"] == "stop"
    assert drafted["usage"] == plain["usage"]
    # "one two three": the tokens through the stop's last character, and none after it.
    assert plain["usage"]["completion_tokens"] == len("one two three")
    # The same tokens and logprobs. (text_offset is left out: it follows the text sent per
    # update, and a stop string's held-back start shifts it without speculation.)
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert drafted["choices"][0]["logprobs"][key] == plain["choices"][0]["logprobs"][key]
    assert len(plain["choices"][0]["logprobs"]["tokens"]) == len("one two three")


def test_streamed_usage_ends_at_the_stop_as_without_speculation():
    def streamed(tokens_per_step: int) -> dict:
        with GatewayServer() as gw:
            worker = gw.worker(tokens_per_step=tokens_per_step,
                               reply=cyclic_reply("one two three four ")).start()
            try:
                assert worker.ready.wait(5)
                body = {"model": MODEL, "messages": [{"role": "user", "content": "count"}],
                        "max_tokens": 60, "stop": ["three"], "stream": True,
                        "stream_options": {"include_usage": True}}
                with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body,
                                  timeout=10) as r:
                    lines = [json.loads(line[6:]) for line in r.iter_lines()
                             if line.startswith("data: ") and line != "data: [DONE]"]
                return lines[-1]["usage"]
            finally:
                worker.stop()

    assert streamed(8) == streamed(1)
