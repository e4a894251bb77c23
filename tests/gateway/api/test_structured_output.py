"""response_format, tools and tool_choice, logit_bias and echo in the gateway: what reaches the
worker (SUBMIT's grammar and params) and what the client gets back (OpenAI's shapes), with a
fake worker whose reply is scripted. The constrained decoding itself: tests/worker/test_grammar.py
and tests/e2e/test_structured_output_real_model.py."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.helpers import GatewayServer, fixed_reply
from tests.gateway.test_app import post_stream
from zeroserve.gateway.api.limits import RequestLimits
from zeroserve.gateway.api.openai_schema import parse_chat, parse_completion
from zeroserve.gateway.api.tool_calls import (
    ToolCallStream,
    parse_calls,
    prepare_messages,
)
from zeroserve.gateway.errors import APIError
from zeroserve.gateway.text.chat_template import ChatTemplate

NAMES = ("served",)
MSGS = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def error_of(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    return e.value


# --- validation -------------------------------------------------------------------------

def test_response_format_becomes_a_json_schema_grammar():
    req = parse_chat({"messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a_1", "schema": SCHEMA,
                                               "strict": True}}}, NAMES)
    kind, source = req.sampling.worker_params(8, 0)["grammar"]
    assert kind == "json_schema" and json.loads(source) == SCHEMA
    req = parse_chat({"messages": MSGS, "response_format": {"type": "json_object"}}, NAMES)
    assert json.loads(req.sampling.grammar.source) == {"type": "object"}
    assert parse_chat({"messages": MSGS}, NAMES).sampling.worker_params(8, 0).get(
        "grammar") is None
    req = parse_completion({"prompt": "x", "response_format": {"type": "json_object"}}, NAMES)
    assert req.sampling.grammar.kind == "json_schema"
    req = parse_completion({"prompt": "x", "guided_regex": "[0-9]+"}, NAMES)
    assert req.sampling.grammar.to_wire() == ["regex", "[0-9]+"]


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": [1]}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "a" * 300_000}}}},
     "response_format.json_schema.schema"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
])
def test_mistakes_are_400_naming_the_parameter(body, param):
    from zeroserve.gateway.api.limits import RequestLimits

    e = error_of(parse_chat, {"messages": MSGS, **body}, NAMES, RequestLimits(vocab_size=1000))
    assert e.status == 400 and e.param == param, e.message


def test_tool_choice_modes_and_their_grammars():
    assert parse_chat({"messages": MSGS, "tools": [WEATHER], "tool_choice": "none"},
                      NAMES).tools is None
    auto = parse_chat({"messages": MSGS, "tools": [WEATHER]}, NAMES)
    assert auto.tools.mode == "auto" and auto.sampling.grammar is None
    named = parse_chat({"messages": MSGS, "tools": [WEATHER, TIME], "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, NAMES)
    assert named.tools.mode == "named" and named.tools.name == "get_time"
    # The declared properties only (additionalProperties false where the schema is silent).
    assert json.loads(named.sampling.grammar.source) == TIME["function"]["parameters"] | {
        "additionalProperties": False}
    required = parse_chat({"messages": MSGS, "tools": [WEATHER, TIME],
                           "tool_choice": "required", "parallel_tool_calls": False}, NAMES)
    schema = json.loads(required.sampling.grammar.source)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == [
        "get_weather", "get_time"]
    # Without parallel_tool_calls a forced call is one call; asked for, several may come.
    default = parse_chat({"messages": MSGS, "tools": [WEATHER], "tool_choice": "required"},
                         NAMES)
    assert json.loads(default.sampling.grammar.source)["maxItems"] == 1
    parallel = parse_chat({"messages": MSGS, "tools": [WEATHER], "tool_choice": "required",
                           "parallel_tool_calls": True}, NAMES)
    assert "maxItems" not in json.loads(parallel.sampling.grammar.source)


def test_forced_arguments_hold_only_the_declared_keys_unless_the_schema_says():
    nested = {"type": "object", "properties": {
        "city": {"type": "string"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {
            "k": {"type": "string"}}}},
        "extra": {"type": "object", "properties": {"a": {"type": "string"}},
                  "additionalProperties": True}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": nested}}
    body = {"messages": MSGS, "tools": [tool], "tool_choice": "required"}
    schema = json.loads(parse_chat(body, NAMES).sampling.grammar.source)
    args = schema["items"]["properties"]["arguments"]
    assert args["additionalProperties"] is False
    assert args["properties"]["where"]["additionalProperties"] is False
    assert args["properties"]["tags"]["items"]["additionalProperties"] is False
    assert args["properties"]["extra"]["additionalProperties"] is True  # explicit wins
    assert "additionalProperties" not in args["properties"]["city"]
    # The operator's flag (--allow-extra-tool-arguments) leaves schemas as they are.
    open_limits = RequestLimits(close_tool_schemas=False)
    schema = json.loads(parse_chat(body, NAMES, open_limits).sampling.grammar.source)
    assert schema["items"]["properties"]["arguments"] == nested
    # No parameters: any object, as before.
    bare = {"type": "function", "function": {"name": "g"}}
    named = parse_chat({"messages": MSGS, "tools": [bare], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, NAMES)
    assert json.loads(named.sampling.grammar.source) == {"type": "object"}


def test_logit_bias_travels_as_pairs():
    req = parse_completion({"prompt": "x", "logit_bias": {"17": -100, "3": 2.5}}, NAMES)
    assert req.sampling.worker_params(4, 0)["logit_bias"] == [[17, -100.0], [3, 2.5]]
    assert "logit_bias" not in parse_completion({"prompt": "x"}, NAMES).sampling.worker_params(
        4, 0)


# --- tools in the prompt -------------------------------------------------------------------

def test_tools_reach_a_template_that_reads_them():
    source = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
              "{% for m in messages %}{{ m.role }}:{{ m.content }}"
              "{% for c in m.tool_calls or [] %}<{{ c.function.arguments.city }}>{% endfor %}"
              "{% endfor %}")
    req = parse_chat({"messages": MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
        "tools": [WEATHER, TIME]}, NAMES)
    messages, kwargs = prepare_messages(req.prompt.messages, req.tools, source)
    text = ChatTemplate(source).render(messages, True, **kwargs)
    assert text == "[get_weather][get_time]user:Weather in Paris?assistant:<Paris>tool:sunny"


def test_a_template_without_tools_gets_them_in_a_system_message():
    template = ChatTemplate(None)  # the ChatML fallback (SmolLM2's shape) ignores tools
    req = parse_chat({"messages": [{"role": "system", "content": "Be brief."}] + MSGS + [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"}],
        "tools": [WEATHER]}, NAMES)
    messages, kwargs = prepare_messages(req.prompt.messages, req.tools, template.source)
    assert kwargs == {}
    text = template.render(messages, True)
    system = text.split("<|im_end|>")[0]
    assert '"name": "get_weather"' in system and "<tool_call>" in system
    assert system.endswith("Be brief.")
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>') in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


# --- parsing the output --------------------------------------------------------------------

def tools(mode="auto", name=None):
    body = {"messages": MSGS, "tools": [WEATHER, TIME]}
    if mode != "auto":
        body["tool_choice"] = mode if name is None else {
            "type": "function", "function": {"name": name}}
    return parse_chat(body, NAMES).tools


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>', "Sure.", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', None,
     [("get_weather", {"city": "A"}), ("get_time", {"zone": "UTC"})]),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),  # EOS
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),  # Llama 3
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', None,
     [("get_time", {"zone": "CET"})]),
    ('{"name": "launch_rockets", "parameters": {}}', '{"name": "launch_rockets", '
     '"parameters": {}}', []),  # not one of the tools: plain content
    ("It is sunny.", "It is sunny.", []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
])
def test_auto_output_parsing_whole_and_streamed(text, content, calls):
    got_content, got_calls = parse_calls(text, tools())
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for size in (1, 3, 1000):  # any split of the text gives the same calls
        stream = ToolCallStream(tools())
        deltas = [d for i in range(0, len(text), size) for d in stream.push(text[i:i + size])]
        deltas += stream.finish()
        assert streamed_calls(deltas) == calls
        streamed_text = "".join(d.get("content", "") for d in deltas).strip()
        assert streamed_text == (content or "")


def streamed_calls(deltas: list[dict]) -> list[tuple[str, dict]]:
    """Rebuild calls from OpenAI deltas as a client does (by index)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        for piece in d.get("tool_calls", []):
            call = calls.setdefault(piece["index"], {"name": None, "arguments": ""})
            if "id" in piece:
                assert piece["id"].startswith("call_") and piece["type"] == "function"
                call["name"] = piece["function"]["name"]
            call["arguments"] += piece["function"]["arguments"]
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


def test_forced_outputs_stream_arguments_as_they_come():
    text = '[{"name": "get_weather", "arguments": {"city": "Pa}r\\"is"}}, ' \
           '{"name": "get_time", "arguments": {}}]'
    stream = ToolCallStream(tools("required"))
    deltas = [d for ch in text for d in stream.push(ch)] + stream.finish()
    assert streamed_calls(deltas) == [("get_weather", {"city": 'Pa}r"is'}),
                                      ("get_time", {})]
    first_args = [d for d in deltas if d["tool_calls"][0]["index"] == 0][1:]
    assert len(first_args) > 5  # fragments, not one piece at the end
    assert [(c.name, json.loads(c.arguments)) for c in parse_calls(
        text, tools("required"))[1]] == streamed_calls(deltas)
    named = ToolCallStream(tools("named", "get_time"))
    deltas = named.push('{"zone"') + named.push(': "UTC"}') + named.finish()
    assert streamed_calls(deltas) == [("get_time", {"zone": "UTC"})]



def streamed_raw_calls(deltas: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments text) per call from OpenAI deltas, checking that each call's first
    piece (index, id, type, name) comes before any of its arguments."""
    calls: dict[int, list] = {}
    for d in deltas:
        for piece in d.get("tool_calls", []):
            if "id" in piece:
                assert piece["index"] not in calls and piece["type"] == "function"
                calls[piece["index"]] = [piece["function"]["name"], ""]
            calls[piece["index"]][1] += piece["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(c) for _, c in sorted(calls.items())]


def stream_in_pieces(tool_choice, text: str, size: int) -> tuple[list[dict], ToolCallStream]:
    stream = ToolCallStream(tool_choice)
    deltas = [d for i in range(0, len(text), size) for d in stream.push(text[i:i + size])]
    return deltas + stream.finish(), stream


@pytest.mark.parametrize(("text", "calls"), [
    # The grammar's own order: its schema's keys are sorted, so "arguments" comes first.
    ('[{"arguments": {"city": "Paris"}, "name": "get_weather"}]',
     [("get_weather", {"city": "Paris"})]),
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     [("get_weather", {"city": "Paris"})]),
    ('[{"arguments": {"city": "A,\\"}"}, "name": "get_weather"}, '
     '{"name": "get_time", "arguments": {"zone": "UTC"}}, '
     '{"arguments": {}, "name": "get_time"}]',
     [("get_weather", {"city": 'A,"}'}), ("get_time", {"zone": "UTC"}), ("get_time", {})]),
    ('\n[ {\n  "arguments" :{ "city":"Oslo" } ,\n  "name":"get_weather"\n} ,'
     '{"name" : "get_time","arguments":{"zone" : "CET"}}\n]\n',
     [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]),
])
def test_required_calls_stream_as_the_whole_output_parses(text, calls):
    """Whatever the key order and spacing, the streamed calls are the non-streamed ones: the
    same names, and arguments fragments that join to the very same text."""
    _, whole = parse_calls(text, tools("required"))
    assert [(c.name, json.loads(c.arguments)) for c in whole] == calls
    for size in (1, 2, 7, 1000):
        deltas, stream = stream_in_pieces(tools("required"), text, size)
        assert streamed_raw_calls(deltas) == [(c.name, c.arguments) for c in whole]
        assert stream.has_calls and all("content" not in d for d in deltas)


def test_required_arguments_stream_as_they_come_once_the_name_is_known():
    """Name first: the arguments go out in fragments as they arrive. Arguments first: they are
    held until the name (a call's first delta names it) and then sent whole."""
    name_first = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    deltas, _ = stream_in_pieces(tools("required"), name_first, 1)
    assert len([d for d in deltas if "id" not in d["tool_calls"][0]]) > 5
    args_first = '[{"arguments": {"city": "Paris"}, "name": "get_weather"}]'
    stream = ToolCallStream(tools("required"))
    assert stream.push(args_first[:-20]) == []  # the name has not come yet
    deltas = stream.push(args_first[-20:]) + stream.finish()
    assert streamed_raw_calls(deltas) == [("get_weather", '{"city": "Paris"}')]


def test_required_call_cut_short_before_its_name_is_no_call_and_no_content():
    deltas, stream = stream_in_pieces(tools("required"), '[{"arguments": {"city": "Pa', 3)
    assert deltas == [] and not stream.has_calls
    assert parse_calls('[{"arguments": {"city": "Pa', tools("required")) == (None, [])


@pytest.mark.parametrize(("mode", "name", "text", "arguments"), [
    ("required", None, '[{"name": "get_weather", "arguments": {"city": "Pa', '{"city": "Pa'),
    ("named", "get_weather", '{"city": "Pa', '{"city": "Pa'),
])
def test_a_forced_call_cut_short_is_still_a_call(mode, name, text, arguments):
    """max_tokens cut the call: it is reported as the call it was, arguments cut where the
    output was, never as raw JSON in the content; the stream says the same."""
    content, calls = parse_calls(text, tools(mode, name))
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", arguments)]
    deltas, stream = stream_in_pieces(tools(mode, name), text, 2)
    assert streamed_raw_calls(deltas) == [("get_weather", arguments)]
    assert all("content" not in d for d in deltas)

# --- through the app -----------------------------------------------------------------------

@pytest.fixture
def served_reply():
    """A gateway whose fake worker answers with the text the test sets."""
    reply = {"text": ""}
    with GatewayServer() as gw:
        worker = gw.worker(reply=lambda p, params: fixed_reply(reply["text"])(p, params))
        worker.start()
        assert worker.ready.wait(5)
        yield gw, worker, reply
        worker.stop()


def test_named_tool_call_over_http(served_reply):
    gw, worker, reply = served_reply
    reply["text"] = '{"city": "Paris"}'
    body = {"messages": MSGS, "tools": [WEATHER], "max_tokens": 50,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert worker.submits[0].grammar == ["json_schema", json.dumps(
        WEATHER["function"]["parameters"] | {"additionalProperties": False},
        separators=(",", ":"))]
    assert "grammar" not in worker.submits[0].params

    chunks = post_stream(gw, "/v1/chat/completions", {**body, "stream": True})
    assert chunks[-1] == "[DONE]"
    choices = [c["choices"][0] for c in chunks[:-1]]
    assert choices[0]["delta"]["role"] == "assistant"
    pieces = [p for c in choices for p in c["delta"].get("tool_calls", [])]
    assert pieces[0]["id"].startswith("call_") and pieces[0]["function"]["name"] == "get_weather"
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"city": "Paris"}'
    assert len(pieces) > 2  # argument fragments as the tokens came
    assert choices[-1]["finish_reason"] == "tool_calls"



@pytest.mark.parametrize("parallel", [None, True])
def test_required_tool_call_over_http_streams_as_it_answers_whole(served_reply, parallel):
    """The grammar writes "arguments" before "name": the stream still carries the call."""
    gw, worker, reply = served_reply
    reply["text"] = '[{"arguments": {"city": "Paris"}, "name": "get_weather"}]'
    body = {"messages": MSGS, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 80}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    choice = httpx.post(gw.url + "/v1/chat/completions", json=body,
                        timeout=10).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

    chunks = post_stream(gw, "/v1/chat/completions", {**body, "stream": True})
    assert chunks[-1] == "[DONE]"
    choices = [c["choices"][0] for c in chunks[:-1] if c["choices"]]
    assert choices[0]["delta"]["role"] == "assistant"
    deltas = [c["delta"] for c in choices if c["delta"].get("tool_calls")]
    assert streamed_raw_calls(deltas) == [("get_weather", '{"city": "Paris"}')]
    assert choices[-1]["finish_reason"] == "tool_calls"

@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_a_forced_call_cut_by_max_tokens_over_http(served_reply, choice):
    gw, _, reply = served_reply
    head = '[{"name": "get_weather", "arguments": ' if choice == "required" else ""
    reply["text"] = head + '{"city": "Paris, the capital of France, on the Seine"}'
    body = {"messages": MSGS, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 50}
    choice_out = httpx.post(gw.url + "/v1/chat/completions", json=body,
                            timeout=10).json()["choices"][0]
    assert choice_out["finish_reason"] == "length"
    assert choice_out["message"]["content"] is None
    [call] = choice_out["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather",
                                "arguments": reply["text"][len(head):50]}
    chunks = post_stream(gw, "/v1/chat/completions", {**body, "stream": True})
    choices = [c["choices"][0] for c in chunks[:-1] if c["choices"]]
    assert choices[-1]["finish_reason"] == "length"
    deltas = [c["delta"] for c in choices if c["delta"].get("tool_calls")]
    assert streamed_raw_calls(deltas) == [("get_weather", call["function"]["arguments"])]
    assert not any(c["delta"].get("content") for c in choices)


def test_auto_tool_call_and_plain_answer_over_http(served_reply):
    gw, worker, reply = served_reply
    body = {"messages": MSGS, "tools": [WEATHER, TIME], "max_tokens": 100}
    reply["text"] = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    choice = httpx.post(gw.url + "/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_time", "arguments": '{"zone": "UTC"}'}
    assert worker.submits[0].grammar is None  # auto: the model decides, unconstrained
    # The tools reached the prompt (the byte tokenizer's ChatML fallback ignores `tools`).
    prompt = bytes(t for t in worker.submits[0].prompt_token_ids if t < 256).decode()
    assert "<tools>" in prompt and '"get_time"' in prompt
    reply["text"] = "It is noon."
    choice = httpx.post(gw.url + "/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "It is noon."}


def test_response_format_and_logit_bias_reach_the_worker(served_reply):
    gw, worker, reply = served_reply
    reply["text"] = '{"a": 1}'
    r = httpx.post(gw.url + "/v1/chat/completions", json={
        "messages": MSGS, "max_tokens": 20, "logit_bias": {"65": 10},
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": SCHEMA}}})
    assert r.json()["choices"][0]["message"]["content"] == '{"a": 1}'
    assert worker.submits[0].grammar[0] == "json_schema"
    assert worker.submits[0].params["logit_bias"] == [[65, 10.0]]


def test_echo_puts_the_prompt_first(served_reply):
    gw, worker, reply = served_reply
    reply["text"] = " world"
    body = {"prompt": ["Hello", "Hi"], "max_tokens": 10, "echo": True, "n": 2}
    texts = [c["text"] for c in httpx.post(gw.url + "/v1/completions", json=body).json()[
        "choices"]]
    assert texts == ["Hello world", "Hello world", "Hi world", "Hi world"]
    tokens = {**body, "prompt": [72, 105], "n": 1}  # a token prompt echoes as its text
    assert httpx.post(gw.url + "/v1/completions", json=tokens).json()["choices"][0][
        "text"] == "Hi world"
    chunks = post_stream(gw, "/v1/completions", {**body, "stream": True})
    streamed = ["", "", "", ""]
    for c in chunks[:-1]:
        for choice in c["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == texts


def test_malformed_call_history_renders_or_is_a_400_never_a_500(served_reply):
    gw, _, reply = served_reply
    reply["text"] = "ok"
    for calls in ("x", [{"function": "f"}], [3], [{"function": {"name": 5, "arguments": "{"}}]):
        r = httpx.post(gw.url + "/v1/chat/completions", json={
            "messages": MSGS + [{"role": "assistant", "tool_calls": calls}],
            "tools": [WEATHER], "max_tokens": 5})
        assert r.status_code in (200, 400), (calls, r.text)


def test_echo_with_logprobs_gives_the_prompts_logprobs_first():
    """OpenAI's echo + logprobs: the prompt's tokens lead the logprobs, the first with None;
    the worker is asked for prompt logprobs (a fake worker answers with made-up values)."""
    from dataclasses import dataclass

    from tests.gateway.helpers import FakeWorker

    @dataclass
    class PromptLogprobWorker(FakeWorker):
        def _step(self):
            outputs = super()._step()
            for out in outputs:
                sub = next(s for s in self.submits if s.request_id == out.request_id)
                if out.num_output_tokens == len(out.new_token_ids) and sub.params.get(
                        "prompt_logprobs") is not None:  # the stream's first output
                    out.prompt_logprobs = [[-1.0 - i, [[t, -0.5]]]
                                           for i, t in enumerate(sub.prompt_token_ids[1:])]
            return outputs

    with GatewayServer() as gw:
        worker = PromptLogprobWorker(*gw.config.endpoints, reply=fixed_reply("ok")).start()
        assert worker.ready.wait(5)
        body = {"prompt": "Hi!", "max_tokens": 5, "echo": True, "logprobs": 1}
        choice = httpx.post(gw.url + "/v1/completions", json=body).json()["choices"][0]
        assert worker.submits[-1].params["prompt_logprobs"] == 1
        lp = choice["logprobs"]
        assert choice["text"] == "Hi!ok"
        assert lp["tokens"] == ["H", "i", "!", "o", "k"]
        assert lp["token_logprobs"][:3] == [None, -1.0, -2.0]
        assert lp["top_logprobs"][:3] == [None, {"i": -0.5}, {"!": -0.5}]
        assert lp["text_offset"] == [0, 1, 2, 3, 4]
        chunks = post_stream(gw, "/v1/completions", {**body, "stream": True})
        streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
        for c in chunks[:-1]:
            for part in c["choices"]:
                for k in streamed:
                    streamed[k] += (part["logprobs"] or {}).get(k, [])
        assert streamed == {k: lp[k] for k in streamed}
        plain = httpx.post(gw.url + "/v1/completions", json={**body, "echo": False}).json()
        assert "prompt_logprobs" not in worker.submits[-1].params
        assert plain["choices"][0]["logprobs"]["tokens"] == ["o", "k"]
        worker.stop()
