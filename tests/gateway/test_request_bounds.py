"""What one small request may cost the gateway: nothing left behind after a 400, bounded
work on the event loop, and the OpenAI behaviours that scoring clients rely on."""

from __future__ import annotations

import json

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


# --- JSON nested inside strings --------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}
DEEP = "[" * 5000 + "]" * 5000  # json.loads of it raises RecursionError


def history_with_arguments(arguments: str) -> list[dict]:
    return [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_deeply_nested_arguments_in_the_history_are_a_400(served, path):
    gw, worker = served
    r = httpx.post(gw.url + path, json={"messages": history_with_arguments(DEEP),
                                        "tools": [WEATHER]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[1].tool_calls[0].function.arguments"
    assert "deeper than 64" in error["message"]
    assert not worker.submits
    assert_no_leaks(gw)


def test_arguments_that_are_not_json_still_render(served):
    gw, _ = served
    r = httpx.post(gw.url + "/tokenize",
                   json={"messages": history_with_arguments('{"city": "Par')})
    assert r.status_code == 200
    assert r.json()["count"] > 0


@pytest.fixture
def served_reply():
    """A gateway whose fake worker answers with the text the test sets, 64 tokens a step."""
    reply = {"text": ""}
    with GatewayServer() as gw:
        worker = gw.worker(reply=lambda p, params: list(reply["text"].encode()),
                           tokens_per_step=64)
        worker.start()
        assert worker.ready.wait(5)
        yield gw, worker, reply
        worker.stop()


DEEP_CALL = '<tool_call>{"name": "get_weather", "arguments": ' + "[" * 1500 + "]" * 1500 \
    + "}</tool_call>"


def test_a_deeply_nested_call_in_the_output_is_kept_as_content(served_reply):
    gw, _, reply = served_reply
    reply["text"] = DEEP_CALL
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER],
            "max_tokens": 3200}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=20)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == DEEP_CALL and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"

    with httpx.stream("POST", gw.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=20) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all("error" not in c for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == DEEP_CALL
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert_no_leaks(gw)


def test_bounded_json_turns_every_failure_into_a_value_error():
    from zeroserve.gateway.text import bounded_json

    assert bounded_json.loads('{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]}
    assert bounded_json.loads("[" * 64 + "]" * 64) is not None
    for text in ("[" * 65 + "]" * 65, DEEP, '{"a": ', "[" * 100_000):
        with pytest.raises(ValueError):
            bounded_json.loads(text)


def test_large_arguments_are_parsed_off_the_event_loop(served, monkeypatch):
    import threading

    from zeroserve.gateway.api import tool_calls

    threads = []
    real_loads = tool_calls.bounded_json.loads

    def spy(text, *args):
        threads.append(threading.current_thread().name)
        return real_loads(text, *args)

    monkeypatch.setattr(tool_calls.bounded_json, "loads", spy)
    gw, _ = served
    arguments = json.dumps({"rows": [{"city": f"c{i}"} for i in range(10_000)]})
    r = httpx.post(gw.url + "/tokenize", json={"messages": history_with_arguments(arguments)})
    assert r.status_code == 200
    assert threads and all(name.startswith("gateway-cpu") for name in threads), threads


def test_arguments_count_toward_the_conversation_limit(served):
    gw, _ = served
    arguments = json.dumps({"city": "x" * 1_000_000})
    r = httpx.post(gw.url + "/v1/chat/completions",
                   json={"messages": history_with_arguments(arguments)})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "prompt_too_long"


# --- echo: scoring a prompt, and its logprobs once per prompt ---------------------------------

def sse_events(gw, body: dict) -> list:
    with httpx.stream("POST", gw.url + "/v1/completions", json={**body, "stream": True},
                      timeout=20) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def streamed_choices(events: list) -> dict[int, dict]:
    """Per choice index: its text, its logprobs arrays joined, and its finish reason."""
    out: dict[int, dict] = {}
    for event in events:
        for c in event["choices"]:
            acc = out.setdefault(c["index"], {"text": "", "logprobs": None,
                                              "finish_reason": None})
            acc["text"] += c["text"]
            if c["logprobs"] is not None:
                if acc["logprobs"] is None:
                    acc["logprobs"] = {k: [] for k in c["logprobs"]}
                for k, v in c["logprobs"].items():
                    acc["logprobs"][k] += v
            acc["finish_reason"] = c["finish_reason"] or acc["finish_reason"]
    return out


PROMPT_LOGPROBS = {"tokens": ["H", "i", "!"], "token_logprobs": [None, -1.0, -2.0],
                   "top_logprobs": [None, {"i": -0.5}, {"!": -0.5}], "text_offset": [0, 1, 2]}


def test_echo_with_max_tokens_0_scores_the_prompt(served):
    gw, worker = served
    body = {"prompt": "Hi!", "echo": True, "max_tokens": 0, "logprobs": 1}
    r = httpx.post(gw.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice == {"index": 0, "text": "Hi!", "logprobs": PROMPT_LOGPROBS,
                      "finish_reason": "length"}
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 0,
                                 "total_tokens": 3}
    assert worker.submits[-1].params["max_tokens"] == 1  # the worker cannot make none
    assert worker.submits[-1].params["prompt_logprobs"] == 1

    events = sse_events(gw, {**body, "stream_options": {"include_usage": True}})
    assert streamed_choices(events[:-1]) == {0: {k: v for k, v in choice.items()
                                                 if k != "index"}}
    assert events[-1]["usage"]["completion_tokens"] == 0

    plain = httpx.post(gw.url + "/v1/completions", json={**body, "logprobs": None})
    assert plain.json()["choices"][0] == {"index": 0, "text": "Hi!", "logprobs": None,
                                          "finish_reason": "length"}
    assert_no_leaks(gw)


def test_max_tokens_0_without_echo_is_still_a_400(served):
    gw, worker = served
    r = httpx.post(gw.url + "/v1/completions", json={"prompt": "Hi!", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert not worker.submits


def test_prompt_logprobs_are_asked_once_per_prompt_and_shared_by_its_choices(served):
    gw, worker = served
    body = {"prompt": ["Hi!", "Yo?"], "echo": True, "max_tokens": 2, "logprobs": 1, "n": 3}
    r = httpx.post(gw.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    asked = [s.params.get("prompt_logprobs") for s in worker.submits]
    assert sorted(asked, key=str) == [1, 1, None, None, None, None]  # one per prompt
    for c in choices:
        prompt = "Hi!" if c["index"] < 3 else "Yo?"
        assert c["text"] == prompt + "He"
        lp = c["logprobs"]
        assert lp["tokens"] == [*prompt, "H", "e"]
        assert lp["token_logprobs"] == [None, -1.0, -2.0, -0.25, -0.25]
        assert lp["text_offset"] == [0, 1, 2, 3, 4]
    assert choices[0]["logprobs"] == PROMPT_LOGPROBS | {
        "tokens": ["H", "i", "!", "H", "e"], "token_logprobs": [None, -1.0, -2.0, -0.25, -0.25],
        "top_logprobs": [None, {"i": -0.5}, {"!": -0.5}, {"H": -0.25}, {"e": -0.25}],
        "text_offset": [0, 1, 2, 3, 4]}

    streamed = streamed_choices(sse_events(gw, body))
    assert streamed == {c["index"]: {k: c[k] for k in ("text", "logprobs", "finish_reason")}
                        for c in choices}
    assert_no_leaks(gw)


def test_n_is_capped_with_prompt_logprobs(served):
    gw, worker = served
    r = httpx.post(gw.url + "/v1/completions",
                   json={"prompt": "Hi!", "echo": True, "logprobs": 1, "n": 5})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "n" and "at most 4" in error["message"]
    assert httpx.post(gw.url + "/v1/completions",
                      json={"prompt": "Hi!", "echo": True, "n": 5}).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_long_prompt_logprobs_are_formatted_off_the_event_loop(served, monkeypatch, stream):
    import threading

    from zeroserve.gateway.api import responses

    threads = []
    real = responses.prompt_logprobs_json

    def spy(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr("zeroserve.gateway.http.routes.prompt_logprobs_json", spy)
    monkeypatch.setattr("zeroserve.gateway.http.streaming.prompt_logprobs_json", spy)
    gw, _ = served
    prompt = "The quick brown fox. " * 150  # 3,150 tokens x 6 values
    body = {"prompt": prompt, "echo": True, "max_tokens": 3, "logprobs": 5, "n": 2}
    if stream:
        choices = streamed_choices(sse_events(gw, body))
    else:
        r = httpx.post(gw.url + "/v1/completions", json=body, timeout=20)
        choices = {c["index"]: c for c in r.json()["choices"]}
    assert threads and all(t.startswith("gateway-cpu") for t in threads), threads
    assert len(threads) == 1  # once for the prompt, not once per choice
    for c in choices.values():
        assert len(c["logprobs"]["tokens"]) == len(prompt) + 3
        assert c["logprobs"]["token_logprobs"][len(prompt) - 1] == -1.0 - (len(prompt) - 2)


def test_prompt_logprobs_are_charged_to_the_rate_limit():
    key = "sk-echo"
    body = {"prompt": "x" * 100, "echo": True, "max_tokens": 5, "logprobs": 1}
    with GatewayServer(api_keys=(key,), rate_limit_tpm=300) as gw:
        worker = gw.worker().start()
        try:
            assert worker.ready.wait(5)
            headers = {"Authorization": f"Bearer {key}"}
            r = httpx.post(gw.url + "/v1/completions", json=body, headers=headers)
            assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 105
            # The prompt was computed twice (its logprobs, then the choice's prefill):
            # 205 were charged, ~95 are left, and the same request may cost 205 again.
            again = httpx.post(gw.url + "/v1/completions", json=body, headers=headers)
            assert again.status_code == 429
            assert "may use 205" in again.json()["error"]["message"]
        finally:
            worker.stop()
