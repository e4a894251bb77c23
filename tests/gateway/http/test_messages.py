"""The Anthropic Messages API on a real server with a fake worker: golden responses and
event sequences, the official `anthropic` SDK, tools, errors in Anthropic's shape."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.api.test_anthropic_messages import BAD
from tests.gateway.helpers import GatewayServer, text_tokens, wait_until

anthropic = pytest.importorskip("anthropic")

MODEL = "SmolLM2-135M-Instruct"
REPLY = "Hi! 😀 done."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


def reply(prompt: list[int], params: dict) -> list[int]:
    """A tool call when the prompt offers tools and holds no tool result yet; else REPLY
    (a prompt that says 'STOPHERE' gets it in the reply, for stop sequences)."""
    text = bytes(t for t in prompt if t < 256).decode("utf-8", "replace")
    if "<tools>" in text and "<tool_response>" not in text:
        return text_tokens(CALL)
    if "STOPHERE" in text:
        return text_tokens("one two ### three")
    if "JSONPLEASE" in text:  # (the fake worker does not enforce grammars: it obeys)
        return text_tokens('{"city": "Paris", "temp_c": 18}')
    return text_tokens(REPLY)


@pytest.fixture(scope="module")
def served():
    with GatewayServer(api_keys=("sk-test",)) as gw:
        worker = gw.worker(reply=reply).start()
        assert worker.ready.wait(5)
        yield gw, worker
        worker.stop()


def headers(**extra):
    return {"x-api-key": "sk-test", "anthropic-version": "2023-06-01",
            "anthropic-beta": "some-beta-2025", **extra}


def body(**fields):
    return {"model": MODEL, "max_tokens": 100,
            "messages": [{"role": "user", "content": "Hello"}], **fields}


def post(gw, path, payload, **kw):
    return httpx.post(gw.url + path, json=payload, headers=headers(), timeout=10, **kw)


def sse_events(gw, payload):
    """(event name, data) pairs; the 'event:' line must name the data's type."""
    out = []
    with httpx.stream("POST", gw.url + "/v1/messages", json=payload, headers=headers(),
                      timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                out.append((name, data))
    return out


def anonymize(events):
    for _, data in events:
        if data["type"] == "message_start":
            assert data["message"]["id"].startswith("msg_")
            data["message"]["id"] = "msg_X"
    return events


def usage(output_tokens, input_tokens):
    return {"input_tokens": input_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0, "output_tokens": output_tokens}


# --- golden responses -------------------------------------------------------------------

def test_non_streamed_message_golden(served):
    gw, _ = served
    r = post(gw, "/v1/messages", body(system="Be nice."))
    assert r.status_code == 200, r.text
    message = r.json()
    assert message.pop("id").startswith("msg_")
    num_input = message["usage"]["input_tokens"]
    assert message == {
        "type": "message", "role": "assistant", "model": MODEL,
        "content": [{"type": "text", "text": REPLY}], "stop_reason": "end_turn",
        "stop_sequence": None, "usage": usage(len(text_tokens(REPLY)), num_input)}
    counted = post(gw, "/v1/messages/count_tokens", body(system="Be nice."))
    assert counted.json() == {"input_tokens": num_input}


def test_streamed_message_golden(served):
    gw, _ = served
    events = anonymize(sse_events(gw, body(stream=True)))
    num_input = events[0][1]["message"]["usage"]["input_tokens"]
    text_deltas = [d["delta"]["text"] for n, d in events if n == "content_block_delta"]
    assert "".join(text_deltas) == REPLY and "😀" in text_deltas  # never half a character
    golden = [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_X", "type": "message", "role": "assistant", "model": MODEL,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage(0, num_input)}}),
        ("ping", {"type": "ping"}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        *[("content_block_delta", {"type": "content_block_delta", "index": 0,
                                   "delta": {"type": "text_delta", "text": t}})
          for t in text_deltas],
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": usage(len(text_tokens(REPLY)), num_input)}),
        ("message_stop", {"type": "message_stop"}),
    ]
    assert events == golden


def test_tool_use_golden_streamed_and_not(served):
    gw, _ = served
    r = post(gw, "/v1/messages", body(tools=[WEATHER]))
    message = r.json()
    assert message["stop_reason"] == "tool_use"
    [block] = message["content"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_")
    assert (block["name"], block["input"]) == ("get_weather", {"city": "Paris"})

    events = sse_events(gw, body(tools=[WEATHER], stream=True))
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    start = events[2][1]["content_block"]
    assert start["type"] == "tool_use" and start["input"] == {} and start["name"] == "get_weather"
    partial = "".join(d["delta"]["partial_json"] for n, d in events
                      if n == "content_block_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_stop_sequence_and_max_tokens(served):
    gw, _ = served
    stop = body(messages=[{"role": "user", "content": "STOPHERE"}],
                stop_sequences=["zzz", "###"])
    message = post(gw, "/v1/messages", stop).json()
    assert message["content"] == [{"type": "text", "text": "one two "}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "###")
    events = sse_events(gw, {**stop, "stream": True})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "###"}

    short = post(gw, "/v1/messages", body(max_tokens=3)).json()
    assert short["stop_reason"] == "max_tokens" and short["usage"]["output_tokens"] == 3
    events = sse_events(gw, body(max_tokens=3, stream=True))
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_a_huge_max_tokens_is_lowered_to_the_room_left(served):
    gw, worker = served
    r = post(gw, "/v1/messages", body(max_tokens=64000))
    assert r.status_code == 200, r.text
    submit = next(s for s in reversed(worker.submits))
    assert submit.params["max_tokens"] <= gw.app.state.api.max_model_len - len(
        submit.prompt_token_ids)


# --- the anthropic SDK ------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(served):
    gw, _ = served
    with anthropic.Anthropic(base_url=gw.url, api_key="sk-test", max_retries=0) as c:
        yield c


def test_sdk_create_and_count_tokens(client):
    message = client.messages.create(model=MODEL, max_tokens=100, system="Be nice.",
                                     messages=[{"role": "user", "content": "Hello"}])
    assert message.content[0].text == REPLY and message.stop_reason == "end_turn"
    assert message.usage.output_tokens == len(text_tokens(REPLY))
    counted = client.messages.count_tokens(model=MODEL, system="Be nice.",
                                           messages=[{"role": "user", "content": "Hello"}])
    assert counted.input_tokens == message.usage.input_tokens


def test_sdk_stream(client):
    with client.messages.stream(model=MODEL, max_tokens=100,
                                messages=[{"role": "user", "content": "Hello"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == REPLY
    assert final.content[0].text == REPLY and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(text_tokens(REPLY))


def test_sdk_tool_loop(client):
    """tool_use, then a tool_result follow-up that the model answers in text."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER],
                                   messages=messages)
    assert first.stop_reason == "tool_use"
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input == {"city": "Paris"}
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": "18C, sunny"}]}]
    with client.messages.stream(model=MODEL, max_tokens=100, tools=[WEATHER],
                                messages=messages) as stream:
        second = stream.get_final_message()
    assert second.stop_reason == "end_turn" and second.content[0].text == REPLY


def test_sdk_streamed_tool_use_parses_its_input(client):
    with client.messages.stream(model=MODEL, max_tokens=100, tools=[WEATHER],
                                tool_choice={"type": "auto"},
                                messages=[{"role": "user", "content": "Weather?"}]) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == {"city": "Paris"}


def test_sdk_errors_are_typed(client, served):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=100, messages=[])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", max_tokens=9,
                               messages=[{"role": "user", "content": "x"}])
    assert MODEL in caught.value.body["error"]["message"]  # says which model to ask for
    gw, _ = served
    with anthropic.Anthropic(base_url=gw.url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            bad.messages.create(model=MODEL, max_tokens=9,
                                messages=[{"role": "user", "content": "x"}])
    assert caught.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": caught.value.body["error"]["message"]}}


# --- keys, errors, hostile input ------------------------------------------------------------

def test_keys_by_x_api_key_or_bearer(served):
    gw, _ = served
    url = gw.url + "/v1/messages/count_tokens"
    assert httpx.post(url, json=body(), headers={"x-api-key": "sk-test"}).status_code == 200
    assert httpx.post(url, json=body(),
                      headers={"authorization": "Bearer sk-test"}).status_code == 200
    for bad in ({}, {"x-api-key": "nope"}, {"authorization": "Bearer nope"}):
        r = httpx.post(url, json=body(), headers=bad)
        assert r.status_code == 401
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
        assert "sk-test" not in r.text


def assert_anthropic_error(r, status, kind="invalid_request_error"):
    assert r.status_code == status, r.text
    payload = r.json()
    assert payload["type"] == "error" and set(payload) == {"type", "error"}
    assert payload["error"]["type"] == kind and payload["error"]["message"]


@pytest.mark.parametrize(("payload", "param"), BAD)
def test_malformed_bodies_are_anthropic_shaped_4xx(served, payload, param):
    gw, worker = served
    num_submits = len(worker.submits)
    r = post(gw, "/v1/messages", {"model": MODEL, **payload})
    if param == "model":
        assert_anthropic_error(r, 404, "not_found_error")
    else:
        assert_anthropic_error(r, 400)
    assert len(worker.submits) == num_submits  # refused before any worker saw it
    counted = post(gw, "/v1/messages/count_tokens", {"model": MODEL, **payload})
    assert counted.status_code == 200 or counted.json()["type"] == "error"
    assert counted.status_code < 500


@pytest.mark.parametrize("raw", [b"{", b"[]", b'"x"', b"\xff\xfe", b"{\"max_tokens\": 1e999}",
                                 b'{"a":' * 5000])
def test_broken_json_is_anthropic_shaped_400(served, raw):
    gw, _ = served
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(gw.url + path, content=raw, headers=headers(
            **{"content-type": "application/json"}))
        assert 400 <= r.status_code < 500
        assert r.json()["type"] == "error"


def test_other_http_mistakes_are_anthropic_shaped(served):
    gw, _ = served
    r = httpx.post(gw.url + "/v1/messages", content=b"x", headers=headers(
        **{"content-type": "text/plain"}))
    assert_anthropic_error(r, 415)
    assert_anthropic_error(httpx.get(gw.url + "/v1/messages", headers=headers()), 405)
    assert_anthropic_error(post(gw, "/v1/messages/nope", body()), 404, "not_found_error")
    too_long = body(messages=[{"role": "user", "content": "x" * 5000}])
    r = post(gw, "/v1/messages", too_long)
    assert_anthropic_error(r, 400)
    assert r.json()["error"]["message"].startswith("prompt is too long: ")  # Anthropic's words


def test_rate_limit_and_overload_errors():
    with GatewayServer(rate_limit_rps=0.001, rate_limit_burst=1, queue_timeout_s=0.3) as gw:
        url = gw.url + "/v1/messages"
        r = httpx.post(url, json=body(), timeout=10)  # no worker: waits, then 503
        assert_anthropic_error(r, 503, "overloaded_error")
        r = httpx.post(url, json=body(), timeout=10)
        assert_anthropic_error(r, 429, "rate_limit_error")
        assert "retry-after" in r.headers


def test_worker_failure_mid_stream_is_an_error_event():
    # No other worker comes: the stream waits out the queue timeout (1 s, not the helper's 5).
    with GatewayServer(queue_timeout_s=1.0) as gw:
        worker = gw.worker(reply=lambda p, params: text_tokens("x" * 50), step_s=0.02).start()
        assert worker.ready.wait(5)
        events = []
        with httpx.stream("POST", gw.url + "/v1/messages", json=body(stream=True),
                          timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("event: "):
                    events.append(line[len("event: "):])
                    if events.count("content_block_delta") == 3:
                        worker.stop()  # the worker dies; no other one takes the stream
        assert events[:2] == ["message_start", "ping"]
        assert events[-1] == "error" and "message_stop" not in events
        assert wait_until(lambda: len(gw.gateway.streams) == 0, 5)


# --- Claude Code's request, as it sends it (version 2.1, captured; texts shortened) ----------

CLAUDE_CODE_TOOL = {
    "name": "TaskUpdate", "description": "Update a task.",
    "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema",
                     "type": "object", "additionalProperties": False,
                     "properties": {"taskId": {"type": "string"},
                                    "status": {"anyOf": [{"type": "string",
                                                          "enum": ["pending", "done"]},
                                                         {"type": "string", "const": "deleted"}]},
                                    "metadata": {"type": "object",
                                                 "propertyNames": {"type": "string"},
                                                 "additionalProperties": {}}},
                     "required": ["taskId"]}}


def claude_code_body():
    return {
        "model": "claude-opus-4-8", "max_tokens": 64000, "stream": True,
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
                   {"type": "text", "text": "You are Claude Code.",
                    "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "SYSTEM-PROMPT",
                    "cache_control": {"type": "ephemeral", "scope": "global"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>context</system-reminder>"},
                {"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "MID-CONVERSATION-SYSTEM"}],
        "tools": [CLAUDE_CODE_TOOL, {**WEATHER, "name": "Bash"}],
    }


def test_claude_code_request_is_served(served):
    gw, worker = served
    with httpx.stream("POST", gw.url + "/v1/messages?beta=true", json=claude_code_body(),
                      headers=headers(**{
                          "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                            "mid-conversation-system-2026-04-07",
                          "anthropic-dangerous-direct-browser-access": "true"}),
                      timeout=10) as r:
        assert r.status_code == 200, r.read()
        names = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta",
                                                                      "message_stop"]
    prompt = bytes(t for t in worker.submits[-1].prompt_token_ids if t < 256).decode()
    # The system blocks lead; the mid-conversation system message stays after the user's
    # turn (this ChatML template renders it there).
    order = [prompt.index(s) for s in ("You are Claude Code.", "SYSTEM-PROMPT", "hello",
                                       "MID-CONVERSATION-SYSTEM")]
    assert order == sorted(order)
    assert prompt.startswith("system\n") and "\nsystem\nMID-CONVERSATION-SYSTEM" in prompt
    assert "propertyNames" in prompt  # the tool offered as sent


def test_requests_are_counted_by_endpoint(served):
    gw, _ = served
    from prometheus_client.parser import text_string_to_metric_families

    def count(endpoint):
        text = httpx.get(gw.url + "/metrics", headers=headers()).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "zeroserve:api_requests_total"
                   and s.labels.get("endpoint") == endpoint)

    before = count("messages"), count("chat")
    post(gw, "/v1/messages", body())
    post(gw, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    post(gw, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert (count("messages"), count("chat")) == (
        before[0] + 1, before[1] + 2)


def test_claude_codes_billing_header_leaves_the_prompt_prefix_alone(served):
    """Its suffix changes with every conversation: kept, it would be the prompt's first words
    and no new conversation would find the system prompt in the prefix cache."""
    gw, worker = served
    prompts = []
    for suffix in ("fa0", "667"):
        payload = claude_code_body()
        payload["system"][0]["text"] = (f"x-anthropic-billing-header: cc_version=2.1.197."
                                        f"{suffix}; cc_entrypoint=sdk-cli;")
        payload["stream"] = False
        assert post(gw, "/v1/messages", payload).status_code == 200
        prompts.append(worker.submits[-1].prompt_token_ids)
    assert prompts[0] == prompts[1]
    assert b"billing" not in bytes(t for t in prompts[0] if t < 256)


FIRST_SYSTEM_ONLY = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SYSTEM_DROPPED = (
    "{% for m in messages %}{% if m.role != 'system' or loop.first %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", [FIRST_SYSTEM_ONLY, SYSTEM_DROPPED],
                         ids=["refused", "dropped"])
def test_a_template_without_later_system_messages_gets_them_first(tmp_path, template):
    path = tmp_path / "template.jinja"
    path.write_text(template)
    with GatewayServer(chat_template=str(path)) as gw:
        worker = gw.worker(reply=reply).start()
        assert worker.ready.wait(5)
        payload = body(system="S1", messages=[{"role": "user", "content": "Hello"},
                                              {"role": "system", "content": "S2"}])
        r = httpx.post(gw.url + "/v1/messages", json=payload, timeout=10)
        assert r.status_code == 200, r.text
        prompt = bytes(t for t in worker.submits[-1].prompt_token_ids if t < 256).decode()
        assert prompt == "system\nS1\n\nS2\nuser\nHello\nassistant\n"
        counted = httpx.post(gw.url + "/v1/messages/count_tokens", json=payload).json()
        assert counted["input_tokens"] == len(worker.submits[-1].prompt_token_ids)
        worker.stop()


def test_rich_body_with_any_field_broken_is_never_a_5xx(served):
    from tests.gateway.api.test_anthropic_messages import RICH_BODY, _paths, _replaced

    gw, _ = served
    rich = {**RICH_BODY, "model": MODEL}
    for i, path in enumerate(p for p in _paths(rich) if p):
        value = ([None], {"type": []}, -1, "")[i % 4]
        r = post(gw, "/v1/messages", _replaced(rich, path, value))
        assert r.status_code < 500, (path, value, r.text)
        if r.status_code >= 400:
            assert r.json()["type"] == "error", r.text


@pytest.fixture
def quick_pings(monkeypatch):
    from zeroserve.gateway.http.messages import MessagesStream
    monkeypatch.setattr(MessagesStream, "ping_interval_s", 0.2)


def test_pings_while_waiting_for_the_first_output(quick_pings):
    with GatewayServer() as gw:
        worker = gw.worker(reply=lambda p, params: text_tokens("ok")).start()
        assert worker.ready.wait(5)
        worker.is_stepping = False  # a long prefill
        names = []
        with httpx.stream("POST", gw.url + "/v1/messages", json=body(stream=True),
                          timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("event: "):
                    names.append(line[len("event: "):])
                    if names.count("ping") == 4:
                        worker.is_stepping = True
        assert names[:5] == ["message_start", "ping", "ping", "ping", "ping"]
        assert names[5:] == ["content_block_start", "content_block_delta", "content_block_delta",
                             "content_block_stop", "message_delta", "message_stop"]
        worker.stop()


def test_a_client_gone_while_pinged_aborts_its_request(quick_pings):
    with GatewayServer() as gw:
        worker = gw.worker().start()
        assert worker.ready.wait(5)
        worker.is_stepping = False
        with httpx.stream("POST", gw.url + "/v1/messages", json=body(stream=True),
                          timeout=10) as r:
            lines = r.iter_lines()
            while next(lines) != "event: ping" or len(worker.submits) == 0:
                pass
            next(lines)
            assert next(lines) == ""
            assert next(lines) == "event: ping"  # a second one: pinging, no output yet
        assert wait_until(lambda: worker.aborts, 5)
        assert wait_until(lambda: len(gw.gateway.streams) == 0, 5)
        worker.stop()


def test_sdk_structured_output_parse(client, served):
    """messages.parse(output_format=Model) sends output_config.format: its schema reaches the
    worker as a grammar, and the SDK parses the answer into the model."""
    pydantic = pytest.importorskip("pydantic")

    class Weather(pydantic.BaseModel):
        city: str
        temp_c: int

    _, worker = served
    message = client.messages.parse(model=MODEL, max_tokens=100, output_format=Weather,
                                    messages=[{"role": "user", "content": "JSONPLEASE"}])
    assert message.parsed_output == Weather(city="Paris", temp_c=18)
    kind, source = worker.submits[-1].grammar
    assert kind == "json_schema" and set(json.loads(source)["properties"]) == {"city", "temp_c"}


# --- main's request bounds, through the Messages API ----------------------------------------

@pytest.mark.parametrize("stops", [["x" * 257], ["y" * 250] * 5])
def test_stop_sequences_have_chats_caps(served, stops):
    """256 characters each, 1024 together: a 400 naming stop_sequences, before any worker."""
    gw, worker = served
    num_submits = len(worker.submits)
    r = post(gw, "/v1/messages", body(stop_sequences=stops))
    assert_anthropic_error(r, 400)
    assert "stop_sequences" in r.json()["error"]["message"]
    assert len(worker.submits) == num_submits


def test_tokens_are_reserved_at_admission():
    """A message reserves its prompt + max_tokens against the key's tokens per minute: the
    next one that may not fit is refused up front, in Anthropic's shape."""
    with GatewayServer(api_keys=("sk-test",), rate_limit_tpm=200) as gw:
        worker = gw.worker().start()
        assert worker.ready.wait(5)
        first = post(gw, "/v1/messages", body(max_tokens=100))
        assert first.status_code == 200, first.text
        refused = post(gw, "/v1/messages", body(max_tokens=150))
        assert_anthropic_error(refused, 429, "rate_limit_error")
        assert "retry-after" in refused.headers
        assert len(worker.submits) == 1
        worker.stop()


def test_an_unexpected_failure_mid_stream_is_an_error_event(monkeypatch):
    from zeroserve.gateway.http.messages import MessagesStream
    original = MessagesStream.render

    def render(self, batch):
        if self.output.builder.blocks:
            raise RuntimeError("a bug in rendering")
        return original(self, batch)

    monkeypatch.setattr(MessagesStream, "render", render)
    with GatewayServer() as gw:
        worker = gw.worker(reply=lambda p, params: text_tokens("x" * 50), step_s=0.01).start()
        assert worker.ready.wait(5)
        events = []
        with httpx.stream("POST", gw.url + "/v1/messages", json=body(stream=True),
                          timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[len("data: "):]))
        assert events[-1] == {"type": "error", "error": {
            "type": "api_error", "message": "The server failed while streaming the response."}}
        assert wait_until(lambda: worker.aborts, 5)
        worker.stop()
