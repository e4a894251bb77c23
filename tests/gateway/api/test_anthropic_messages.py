"""Messages bodies -> chat requests: what the template and the worker get, and the 400s."""

from __future__ import annotations

import json

import pytest

from zeroserve.gateway.api.anthropic_messages import (
    merged_system_prompt,
    parse_count_tokens,
    parse_messages,
)
from zeroserve.gateway.api.limits import RequestLimits
from zeroserve.gateway.errors import APIError

NAMES = ("m",)
TOOL = {"name": "get_weather", "description": "Weather.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}


def parse(**body):
    return parse_messages({"max_tokens": 64, **body}, NAMES)


def user(text="hi"):
    return {"role": "user", "content": text}


def test_system_string_and_blocks_lead_the_messages():
    for system in ("Be brief.", [{"type": "text", "text": "Be brief.",
                                  "cache_control": {"type": "ephemeral"}}]):
        req = parse(system=system, messages=[user()])
        assert req.chat.prompt.messages == [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "hi"}]


def test_system_role_message_inside_messages_stays_or_joins_the_leading_system():
    req = parse(system="S1", messages=[user(), {"role": "system", "content": "S2"}])
    assert req.chat.prompt.messages == [{"role": "system", "content": "S1"},
                                        {"role": "user", "content": "hi"},
                                        {"role": "system", "content": "S2"}]
    assert merged_system_prompt(req.chat.prompt).messages == [
        {"role": "system", "content": "S1\n\nS2"}, {"role": "user", "content": "hi"}]
    no_lead = parse(messages=[user(), {"role": "system", "content": [
        {"type": "text", "text": "S2"}]}, {"role": "user", "content": "more"}])
    assert merged_system_prompt(no_lead.chat.prompt).messages == [
        {"role": "system", "content": "S2"}, {"role": "user", "content": "hi"},
        {"role": "user", "content": "more"}]
    assert merged_system_prompt(parse(system="S1", messages=[user()]).chat.prompt) is None


def test_tool_use_and_tool_result_become_chat_tool_calls_and_tool_messages():
    req = parse(tools=[TOOL], messages=[
        user("weather?"),
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "x"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "sunny"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom",
             "is_error": True},
            {"type": "text", "text": "thanks"}]}])
    m = req.chat.prompt.messages
    assert m[1]["role"] == "assistant" and m[1]["content"] == "Checking."
    call = m[1]["tool_calls"][0]
    assert call["id"] == "toolu_1" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert m[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert m[3] == {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"}
    assert m[4] == {"role": "user", "content": "thanks"}
    assert req.chat.tools.mode == "auto"
    assert req.chat.tools.functions[0]["parameters"] == TOOL["input_schema"]


@pytest.mark.parametrize(("choice", "mode", "name", "single"), [
    ({"type": "auto"}, "auto", None, False),
    ({"type": "any"}, "required", None, False),
    ({"type": "tool", "name": "get_weather"}, "named", "get_weather", False),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto", None, True),
])
def test_tool_choice(choice, mode, name, single):
    req = parse(tools=[TOOL], tool_choice=choice, messages=[user()])
    assert (req.chat.tools.mode, req.chat.tools.name, req.is_single_tool_use) == (
        mode, name, single)
    assert (req.chat.sampling.grammar is not None) == (mode != "auto")


def test_tool_choice_none_offers_no_tools():
    assert parse(tools=[TOOL], tool_choice={"type": "none"}, messages=[user()]).chat.tools \
        is None


def test_server_tools_are_dropped_not_refused():
    req = parse(tools=[TOOL, {"type": "web_search_20250305", "name": "web_search"}],
                messages=[user()])
    assert req.dropped_tools == ("web_search",)
    assert [f["name"] for f in req.chat.tools.functions] == ["get_weather"]


def test_sampling_fields_and_ignored_extras():
    req = parse(messages=[user()], temperature=0.5, top_p=0.9, top_k=20,
                stop_sequences=["###", ""], metadata={"user_id": "u"}, service_tier="auto",
                betas=["x"], container=None, thinking={"type": "enabled",
                                                       "budget_tokens": 2048})
    s = req.chat.sampling
    assert (s.temperature, s.top_p, s.top_k, s.stop, s.max_tokens) == (
        0.5, 0.9, 20, ("###",), 64)
    assert req.stop_sequences == ("###",)
    assert req.chat.prompt.extra_template_kwargs == {"enable_thinking": True}
    assert parse(messages=[user()], thinking={"type": "disabled"}
                 ).chat.prompt.extra_template_kwargs == {"enable_thinking": False}


def test_max_tokens_beyond_the_server_limit_is_lowered():
    req = parse_messages({"max_tokens": 32000, "messages": [user()]}, NAMES,
                         RequestLimits(max_tokens_limit=4096))
    assert req.max_tokens == 4096


def test_final_assistant_message_is_a_prefill():
    req = parse(messages=[user(), {"role": "assistant", "content": "The answer is"}])
    assert req.chat.prompt.continue_final_message
    assert not req.chat.prompt.add_generation_prompt


def test_count_tokens_needs_no_max_tokens():
    prompt = parse_count_tokens({"messages": [user()], "tools": [TOOL]}, NAMES)
    assert prompt.tools is not None and prompt.messages[-1]["content"] == "hi"


BAD = [
    ({"messages": [user()]}, "max_tokens"),
    ({"max_tokens": 0, "messages": [user()]}, "max_tokens"),
    ({"max_tokens": "9", "messages": [user()]}, "max_tokens"),
    ({"max_tokens": 9}, "messages"),
    ({"max_tokens": 9, "messages": []}, "messages"),
    ({"max_tokens": 9, "messages": "hi"}, "messages"),
    ({"max_tokens": 9, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 9, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"max_tokens": 9, "messages": [{"role": "user", "content": [{"type": "image",
                                                                    "source": {}}]}]},
     "messages.0.content.0"),
    ({"max_tokens": 9, "messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "messages.0.content.0"),
    ({"max_tokens": 9, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0.text"),
    ({"max_tokens": 9, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": 1, "name": "f", "input": {}}]}]}, "messages.0.content.0"),
    ({"max_tokens": 9, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]}, "messages.0.content.0.tool_use_id"),
    ({"max_tokens": 9, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}]},
     "messages.0.content.0.is_error"),
    ({"max_tokens": 9, "messages": [{"role": "system", "content": "only"}]}, "messages"),
    ({"max_tokens": 9, "messages": [user()], "system": 5}, "system"),
    ({"max_tokens": 9, "messages": [user()], "temperature": 1.5}, "temperature"),
    ({"max_tokens": 9, "messages": [user()], "top_p": 0}, "top_p"),
    ({"max_tokens": 9, "messages": [user()], "top_k": -3}, "top_k"),
    ({"max_tokens": 9, "messages": [user()], "stop_sequences": "x"}, "stop_sequences"),
    ({"max_tokens": 9, "messages": [user()], "stream": "yes"}, "stream"),
    ({"max_tokens": 9, "messages": [user()], "thinking": {"type": "maybe"}}, "thinking"),
    ({"max_tokens": 9, "messages": [user()], "tools": {}}, "tools"),
    ({"max_tokens": 9, "messages": [user()], "tools": [{"name": ["f"], "input_schema": {}}]},
     "tools.0.name"),
    ({"max_tokens": 9, "messages": [user()], "tools": [TOOL], "tool_choice": {"type": "tool",
                                                                            "name": ["x"]}},
     "tool_choice.name"),
    ({"max_tokens": 9, "messages": [user()], "tools": [{**TOOL, "input_schema": {
        "type": "object", "propertyNames": {"pattern": "^a"}}}],
      "tool_choice": {"type": "any"}}, "tools[0].function.parameters"),
    ({"max_tokens": 9, "messages": [user()], "tools": [{"name": "f"}]},
     "tools.0.input_schema"),
    ({"max_tokens": 9, "messages": [user()], "tools": [{**TOOL, "name": "bad name"}]},
     "tools[0].function.name"),
    ({"max_tokens": 9, "messages": [user()], "tools": [TOOL, TOOL]}, "tools[1]"),
    ({"max_tokens": 9, "messages": [user()], "tools": [TOOL], "tool_choice": "auto"},
     "tool_choice"),
    ({"max_tokens": 9, "messages": [user()], "tools": [TOOL],
      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"max_tokens": 9, "messages": [user()], "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 9, "messages": [user()], "model": "gpt-x"}, "model"),
    ({"max_tokens": 9, "messages": [user()], "output_config": "json"}, "output_config"),
    ({"max_tokens": 9, "messages": [user()], "output_config": {"format": {"type": "json"}}},
     "output_config.format"),
    ({"max_tokens": 9, "messages": [user()], "output_format": {"type": "json_schema"}},
     "output_format"),
    ({"max_tokens": 9, "messages": [user()], "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "object", "propertyNames": {}}}}},
     "response_format.json_schema.schema"),
    ({"max_tokens": 9, "messages": [user()], "tools": [TOOL], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "response_format"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_mistakes_are_400_naming_the_field(body, param):
    with pytest.raises(APIError) as caught:
        parse_messages(body, NAMES)
    assert caught.value.status == (404 if param == "model" else 400)
    assert caught.value.param == param
    assert ".function." not in caught.value.message  # the Messages names, not chat's


def test_auto_tools_need_no_enforceable_schema():
    """Claude Code's tools use `propertyNames`, which constrained decoding does not implement:
    only a forced tool's schema must compile; the prompt shows every schema as sent."""
    schema = {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
              "$schema": "http://json-schema.org/draft-07/schema#"}
    tools = [{**TOOL, "input_schema": schema}, {**TOOL, "name": "other"}]
    req = parse(tools=tools, messages=[user()])
    assert req.chat.tools.functions[0]["parameters"] == schema
    named = parse(tools=tools, tool_choice={"type": "tool", "name": "other"},
                  messages=[user()])
    assert named.chat.tools.name == "other" and named.chat.sampling.grammar is not None
    assert named.chat.tools.functions[0]["parameters"] == schema


def test_claude_model_names_mean_the_served_model():
    assert parse(model="claude-opus-4-8", messages=[user()]).model == "m"
    assert parse(model="m", messages=[user()]).model == "m"


def _paths(value, path=()):
    """Every path to a value inside a JSON document."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*path, i))


def _replaced(doc, path, new):
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(doc, dict):
        return {**doc, head: _replaced(doc[head], rest, new)}
    out = list(doc)
    out[head] = _replaced(doc[head], rest, new)
    return out


RICH_BODY = {
    "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "S"}],
    "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop_sequences": ["###"],
    "thinking": {"type": "enabled", "budget_tokens": 100}, "metadata": {"user_id": "u"},
    "tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather",
                                     "disable_parallel_tool_use": True},
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "t", "signature": "s"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False,
             "content": [{"type": "text", "text": "sunny"}]}]},
        {"role": "system", "content": "note"}],
}
WRONG_VALUES = [None, 0, -1, 1e308, "x", "", True, [], [None], {}, {"type": None}]


def test_every_field_of_a_rich_body_replaced_by_anything_is_a_4xx_or_served():
    """No value anywhere makes the parser fail other than with an APIError (a 4xx)."""
    assert parse_messages(RICH_BODY, NAMES).chat.tools.mode == "named"
    for path in _paths(RICH_BODY):
        if not path:
            continue
        for value in WRONG_VALUES:
            body = _replaced(RICH_BODY, path, value)
            try:
                parse_messages(body, NAMES)
                parse_count_tokens(body, NAMES)
            except APIError as e:
                assert 400 <= e.status < 500, (path, value, e.message)


def test_output_config_format_is_a_json_schema_grammar():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for field in ({"output_config": {"effort": "high", "format": {"type": "json_schema",
                                                                  "schema": schema}}},
                  {"output_format": {"type": "json_schema", "schema": schema}}):
        grammar = parse(messages=[user()], **field).chat.sampling.grammar
        assert grammar is not None and json.loads(grammar.source) == schema
    assert parse(messages=[user()], output_config={"effort": "low"}).chat.sampling.grammar \
        is None
