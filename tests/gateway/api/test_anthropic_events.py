"""MessageBuilder: (reasoning, text) deltas -> Anthropic content blocks and stream events.
Synthetic deltas, as a reasoning parser and the detokenizer would hand them over."""

from __future__ import annotations

import json

from zeroserve.gateway.api.anthropic_events import (
    MessageBuilder,
    error_body,
    matched_stop_sequence,
    stop_reason,
    thinking_signature,
    usage,
)
from zeroserve.gateway.api.openai_schema import ToolChoice
from zeroserve.gateway.errors import APIError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}


def kinds(events):
    """Each event as its name plus the delta or block type: easy to compare."""
    out = []
    for name, data in events:
        if name == "content_block_delta":
            out.append(f"delta:{data['delta']['type']}")
        elif name == "content_block_start":
            out.append(f"start:{data['content_block']['type']}")
        else:
            out.append(name)
    return out


def run(builder, pushes):
    events = []
    for reasoning, text in pushes:
        events += builder.push(reasoning, text)
    return events + builder.finish()


def test_text_only_is_one_text_block():
    b = MessageBuilder()
    events = run(b, [("", "Hel"), ("", "lo")])
    assert kinds(events) == ["start:text", "delta:text_delta", "delta:text_delta",
                             "content_block_stop"]
    assert [e[1]["index"] for e in events] == [0, 0, 0, 0]
    assert b.content() == [{"type": "text", "text": "Hello"}]


def test_thinking_then_text_is_two_blocks_with_a_signature():
    b = MessageBuilder()
    events = run(b, [("Let me ", ""), ("think.", ""), ("", "Answer"), ("", ": 4")])
    assert kinds(events) == [
        "start:thinking", "delta:thinking_delta", "delta:thinking_delta",
        "delta:signature_delta", "content_block_stop",
        "start:text", "delta:text_delta", "delta:text_delta", "content_block_stop"]
    assert events[0][1]["content_block"] == {"type": "thinking", "thinking": "",
                                             "signature": ""}
    assert events[3][1]["delta"]["signature"] == thinking_signature("Let me think.")
    assert [e[1]["index"] for e in events[5:]] == [1, 1, 1, 1]
    assert b.content() == [
        {"type": "thinking", "thinking": "Let me think.",
         "signature": thinking_signature("Let me think.")},
        {"type": "text", "text": "Answer: 4"}]


def test_one_update_with_both_deltas_closes_thinking_first():
    b = MessageBuilder()
    events = run(b, [("hmm", "ok")])
    assert kinds(events) == ["start:thinking", "delta:thinking_delta", "delta:signature_delta",
                             "content_block_stop", "start:text", "delta:text_delta",
                             "content_block_stop"]


def test_tool_call_in_the_text_becomes_a_tool_use_block():
    b = MessageBuilder(ToolChoice([WEATHER]))
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    events = run(b, [("", text[i:i + 7]) for i in range(0, len(text), 7)])
    assert kinds(events)[0] == "start:text"
    starts = [e[1] for e in events if e[0] == "content_block_start"]
    assert starts[1]["content_block"]["type"] == "tool_use"
    assert starts[1]["content_block"]["id"].startswith("toolu_")
    assert starts[1]["content_block"]["input"] == {}
    partial = "".join(e[1]["delta"]["partial_json"] for e in events
                      if e[0] == "content_block_delta"
                      and e[1]["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    content = b.content()
    assert content[0] == {"type": "text", "text": "Sure."}
    assert content[1]["name"] == "get_weather" and content[1]["input"] == {"city": "Paris"}
    assert b.has_tool_use
    assert kinds(events)[-1] == "content_block_stop"


def test_forced_named_tool_streams_its_arguments():
    b = MessageBuilder(ToolChoice([WEATHER], "named", name="get_weather"))
    events = run(b, [("", '{"city": '), ("", '"Oslo"}')])
    assert kinds(events) == ["start:tool_use", "delta:input_json_delta",
                             "delta:input_json_delta", "content_block_stop"]
    assert b.content()[0]["input"] == {"city": "Oslo"}


def test_cut_short_arguments_give_an_empty_input():
    b = MessageBuilder(ToolChoice([WEATHER], "named", name="get_weather"))
    run(b, [("", '{"city": "Os')])
    assert b.content()[0]["input"] == {}


def test_single_tool_use_keeps_the_first_call_only():
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
    b = MessageBuilder(ToolChoice([WEATHER]), is_single_tool_use=True)
    events = run(b, [("", call % "A"), ("", call % "B")])
    assert [c["input"] for c in b.content()] == [{"city": "A"}]
    assert kinds(events).count("start:tool_use") == 1


def test_stop_reasons():
    assert stop_reason("stop", False, None) == "end_turn"
    assert stop_reason("length", False, None) == "max_tokens"
    assert stop_reason("stop", True, None) == "tool_use"
    assert stop_reason("length", True, None) == "max_tokens"
    assert stop_reason("stop", False, "###") == "stop_sequence"
    assert matched_stop_sequence("abc END x STOP", ("STOP", "END")) == "END"
    assert matched_stop_sequence("", ("only",)) == "only"


def test_usage_counts_cached_input_apart():
    assert usage(100, 7, 64) == {"input_tokens": 36, "cache_creation_input_tokens": 0,
                                 "cache_read_input_tokens": 64, "output_tokens": 7}


def test_error_types_follow_the_status():
    def kind(status):
        return error_body(APIError(status, "m"))["error"]["type"]
    assert error_body(APIError(400, "bad"))["type"] == "error"
    assert [kind(s) for s in (400, 401, 404, 413, 429, 500, 503, 504)] == [
        "invalid_request_error", "authentication_error", "not_found_error",
        "request_too_large", "rate_limit_error", "api_error", "overloaded_error",
        "timeout_error"]


def test_text_delta_fast_path_writes_the_same_json():
    from zeroserve.gateway.api.anthropic_events import sse_event
    for text in ("plain", 'quote " and \\ back', "日本語 😀", "\n\t\x00"):
        data = {"type": "content_block_delta", "index": 3,
                "delta": {"type": "text_delta", "text": text}}
        raw = sse_event("content_block_delta", data).decode()
        head, line, _, _ = raw.split("\n")
        assert head == "event: content_block_delta"
        assert json.loads(line[len("data: "):]) == data
