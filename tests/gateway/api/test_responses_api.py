"""The Responses API's meaning, without a server: items -> chat messages, tools, the
renamed errors, and the builder's events and response object."""

from __future__ import annotations

import pytest

from zeroserve.gateway.api.responses_output import ResponseBuilder, build_response
from zeroserve.gateway.api.responses_request import items_to_messages, parse_responses
from zeroserve.gateway.errors import APIError

NAMES = ("m",)
TOOL = {"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_items_become_chat_messages():
    items = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]},
    ]
    messages = items_to_messages(items, "Rules.")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert messages[0]["content"] == "Rules.\n\nBe brief."
    assert messages[1]["content"] == "a\nb"
    assert messages[2]["content"] == "Let me look."
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "one"}
    assert messages[4]["content"] == "two"


def test_a_call_with_no_assistant_text_before_it_opens_its_own_message():
    messages = items_to_messages([
        {"role": "user", "content": "q"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}], None)
    assert messages[1]["role"] == "assistant" and messages[1]["content"] == ""


def test_tools_namespaces_and_dropped_types():
    req = parse_responses({"input": "x", "tools": [
        TOOL, {"type": "web_search"}, {"type": "custom", "name": "apply_patch"},
        {"type": "namespace", "name": "crm", "description": "d",
         "tools": [{"type": "function", "name": "lookup"},
                   {"type": "custom", "name": "free"}]}]}, NAMES)
    assert [f["name"] for f in req.chat.tools.functions] == ["get_weather", "lookup"]
    assert req.namespaces == {"lookup": "crm"}
    assert req.dropped_tools == ("web_search", "custom", "crm.custom")


def test_every_tool_dropped_leaves_a_plain_request():
    req = parse_responses({"input": "x", "tools": [{"type": "web_search"}],
                           "tool_choice": "auto"}, NAMES)
    assert req.chat.tools is None


def test_allowed_tools_narrow_the_offer():
    other = dict(TOOL, name="get_time")
    req = parse_responses({"input": "x", "tools": [TOOL, other], "tool_choice": {
        "type": "allowed_tools", "mode": "required",
        "tools": [{"type": "function", "name": "get_time"}]}}, NAMES)
    assert req.chat.tools.mode == "required"
    assert [f["name"] for f in req.chat.tools.functions] == ["get_time"]


def test_fields_map_to_chat():
    req = parse_responses({
        "input": "x", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "text": {"format": {"type": "json_object"}}, "reasoning": {"effort": "none"},
        "store": False, "prompt_cache_key": "k"}, NAMES)
    sampling = req.chat.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p) == (7, 0.5, 0.9)
    assert sampling.grammar is not None
    assert req.chat.prompt.extra_template_kwargs == {"reasoning_effort": "none",
                                                     "enable_thinking": False}
    assert not req.store and req.prompt_cache_key == "k"


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens'"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "bad name!",
                                         "schema": {}}}}, "text.format", "text.format"),
])
def test_chat_errors_name_the_responses_field(body, param, fragment):
    with pytest.raises(APIError) as e:
        parse_responses(body, NAMES)
    assert e.value.param.startswith(param) and fragment in e.value.message


def test_builder_events_for_reasoning_text_and_a_call():
    req = parse_responses({"input": "x", "tools": [TOOL]}, NAMES)
    builder = ResponseBuilder(req, "m")
    events = builder.start() + builder.reasoning("hmm") + builder.text("Sure.")
    events += builder.chat_delta({"tool_calls": [{"index": 0, "id": "call_1", "function": {
        "name": "get_weather", "arguments": ""}}]})
    events += builder.chat_delta({"tool_calls": [{"index": 0, "function": {
        "arguments": '{"city": "Oslo"}'}}]})
    events += builder.finish("stop", {"prompt_tokens": 3, "completion_tokens": 4,
                                      "total_tokens": 7})
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert added[2]["arguments"] == "" and added[2]["status"] == "in_progress"
    response = events[-1]["response"]
    assert [i["type"] for i in response["output"]] == ["reasoning", "message", "function_call"]
    assert response["output"][2]["arguments"] == '{"city": "Oslo"}'
    assert response["usage"] == {"input_tokens": 3, "input_tokens_details": {
        "cached_tokens": 0}, "output_tokens": 4, "output_tokens_details": {
        "reasoning_tokens": 0}, "total_tokens": 7}


def test_a_whole_chat_completion_becomes_the_same_response():
    req = parse_responses({"input": "x", "metadata": {"a": "b"}}, NAMES)
    chat = {"choices": [{"message": {"role": "assistant", "content": "",
                                     "reasoning_content": None},
                         "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
    response = build_response(req, "m", chat).response()
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["type"] for i in response["output"]] == ["message"]  # empty, not missing
    assert response["metadata"] == {"a": "b"}


# --- hostile tool shapes: every one a 4xx, never an exception of another kind ---------------

_ODD_VALUES = (None, 5, 1.5, True, "x", "", [], [5], ["x"], {}, {"name": []}, [{"name": []}],
               [{"name": {"a": 1}}], {"type": "function"}, [{"type": "function", "name": 5}])


def _tool_shapes():
    for value in _ODD_VALUES:
        for key in ("name", "tools", "type", "parameters", "strict", "description"):
            yield [{"type": "namespace", "name": "ns", "tools": [dict(TOOL) | {key: value}]}]
            yield [{"type": "namespace", "name": "ns"} | {key: value}]
            yield [dict(TOOL) | {key: value}]


def _choice_shapes():
    for value in _ODD_VALUES:
        yield value
        for kind in ("function", "allowed_tools", "custom", "web_search"):
            for key in ("name", "tools", "mode"):
                yield {"type": kind, key: value}
            yield {"type": kind, "mode": "required", "tools": [{"type": "function",
                                                                "name": value}]}


def _not_4xx(body: dict) -> bool:
    try:
        parse_responses(body, NAMES)
    except APIError as e:
        return not (400 <= e.status < 500 and e.message)
    except Exception:  # a 500 over HTTP
        return True
    return False


def test_odd_tool_shapes_are_4xx():
    bodies = [{"input": "x", "tools": tools} for tools in _tool_shapes()]
    assert [b for b in bodies if _not_4xx(b)] == []


def test_odd_tool_choice_shapes_are_4xx():
    bodies = [{"input": "x", "tool_choice": choice} | extra for choice in _choice_shapes()
              for extra in ({"tools": [TOOL]}, {})]
    assert [b for b in bodies if _not_4xx(b)] == []
