"""POST /v1/responses against a live gateway and fake worker: golden event sequences,
the official openai SDK (streamed and not, tools and a follow-up turn), stored responses,
input_tokens, and hostile bodies."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from tests.gateway.helpers import GatewayServer, text_tokens, wait_until
from zeroserve.gateway.http.responses_routes import ResponsesStream

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather now",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}


def prompt_text(prompt: list[int]) -> str:
    return bytes(t for t in prompt if t < 256).decode("utf-8", "replace")


def agent_reply(prompt: list[int], params: dict) -> list[int]:
    """A fake model: thinks, then calls get_weather when offered it and no result is in the
    conversation yet; answers from the result when there is one; else says hello."""
    text = prompt_text(prompt)
    # A forced call (the fake worker sees no grammar: the test's input says which).
    if "FORCE-ARRAY" in text:
        return text_tokens('[{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    if "FORCE-OBJECT" in text:
        return text_tokens('{"city": "Paris"}')
    if "<tool_response>" in text:
        return text_tokens("<think>It said sunny.</think>\n\nSunny in Paris.")
    if "get_weather" in text:
        return text_tokens("<think>I should look.</think>\n\n" + CALL)
    return text_tokens("<think>Easy.</think>\n\nHello there.")


@pytest.fixture(scope="module")
def served():
    with GatewayServer(reasoning_parser="qwen3") as gw:
        worker = gw.worker(reply=agent_reply).start()
        assert worker.ready.wait(5)
        yield gw, worker
        worker.stop()


@pytest.fixture(scope="module")
def client(served):
    gw, _ = served
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def stream_events(gw, body: dict) -> list[dict]:
    with httpx.stream("POST", gw.url + "/v1/responses", json=body | {"stream": True},
                      timeout=10) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    events, kinds = [], [line[7:] for line in lines if line.startswith("event: ")]
    for line in lines:
        if line.startswith("data: "):
            events.append(json.loads(line[6:]))
    assert [e["type"] for e in events] == kinds  # each event's `event:` line names it
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def collapse(types: list[str]) -> list[str]:
    """Event types with runs of the same delta type collapsed to one."""
    out: list[str] = []
    for t in types:
        if not (out and t == out[-1] and t.endswith(".delta")):
            out.append(t)
    return out


# --- golden sequences ------------------------------------------------------------------------

def test_streamed_text_with_reasoning_golden_sequence(served):
    gw, _ = served
    events = stream_events(gw, {"input": "hi", "max_output_tokens": 100})
    assert collapse([e["type"] for e in events]) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.completed"]
    done = events[-1]["response"]
    assert done["status"] == "completed" and events[0]["response"]["status"] == "in_progress"
    reasoning, message = done["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Easy."}]
    assert message["content"][0]["text"] == "Hello there."
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Hello there."
    assert done["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    assert done["usage"]["total_tokens"] == (done["usage"]["input_tokens"]
                                             + done["usage"]["output_tokens"])


def test_streamed_tool_call_golden_sequence(served):
    gw, _ = served
    events = stream_events(gw, {"input": "Weather in Paris?", "tools": [WEATHER_TOOL],
                                "max_output_tokens": 200})
    types = collapse([e["type"] for e in events])
    assert types[-4:] == ["response.function_call_arguments.delta",
                          "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    call = events[-1]["response"]["output"][-1]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("call_") and call["status"] == "completed"
    assert not any(e["type"] == "response.output_text.delta" for e in events)


def test_non_streamed_matches_the_stream(served):
    gw, _ = served
    body = httpx.post(gw.url + "/v1/responses", timeout=10, json={
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "instructions": "Be brief.", "metadata": {"k": "v"},
        "prompt_cache_key": "conversation-1"}).json()
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert body["status"] == "completed" and body["metadata"] == {"k": "v"}
    assert body["instructions"] == "Be brief." and body["prompt_cache_key"] == "conversation-1"
    assert [i["type"] for i in body["output"]] == ["reasoning", "message"]
    assert body["output"][1]["content"][0]["text"] == "Hello there."


def test_logprobs_when_included(served):
    gw, _ = served
    body = {"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    whole = httpx.post(gw.url + "/v1/responses", json=body, timeout=10).json()
    part = whole["output"][-1]["content"][0]
    assert part["logprobs"] and {"token", "logprob", "top_logprobs"} <= set(part["logprobs"][0])
    events = stream_events(gw, body)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert all(len(e["logprobs"]) >= 1 for e in deltas)
    plain = httpx.post(gw.url + "/v1/responses", json={"input": "hi"}, timeout=10).json()
    assert plain["output"][-1]["content"][0]["logprobs"] == []


def test_max_output_tokens_makes_it_incomplete(served):
    gw, _ = served
    events = stream_events(gw, {"input": "hi", "max_output_tokens": 3})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    body = httpx.post(gw.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 3},
                      timeout=10).json()
    assert body["status"] == "incomplete"


# --- the openai SDK --------------------------------------------------------------------------

def test_sdk_create_and_tool_loop_with_a_follow_up_turn(served, client):
    gw, worker = served
    first = client.responses.create(model="SmolLM2-135M-Instruct", input="Weather in Paris?",
                                    tools=[WEATHER_TOOL])
    calls = [i for i in first.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": calls[0].call_id,
              "output": "sunny, 24C"}
    # Stateless: the whole conversation again, with the call's output.
    second = client.responses.create(
        model="SmolLM2-135M-Instruct", tools=[WEATHER_TOOL],
        input=[{"role": "user", "content": "Weather in Paris?"},
               *[i.model_dump(exclude_none=True) for i in first.output], result])
    assert second.output_text == "Sunny in Paris."
    assert "sunny, 24C" in prompt_text(worker.submits[-1].prompt_token_ids)
    # Stored: previous_response_id carries the conversation.
    third = client.responses.create(model="SmolLM2-135M-Instruct", tools=[WEATHER_TOOL],
                                    previous_response_id=first.id, input=[result])
    assert third.output_text == "Sunny in Paris."
    prompt = prompt_text(worker.submits[-1].prompt_token_ids)
    assert "Weather in Paris?" in prompt and "sunny, 24C" in prompt


def test_sdk_stream(served, client):
    with client.responses.stream(model="SmolLM2-135M-Instruct", input="hi") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == "Hello there." == final.output_text
    assert final.usage.output_tokens > 0


def test_sdk_stream_with_tools(served, client):
    stream = client.responses.create(model="SmolLM2-135M-Instruct", input="Weather?",
                                      tools=[WEATHER_TOOL], stream=True)
    events = list(stream)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
    assert events[-1].type == "response.completed"


def test_forced_calls(served, client):
    named = client.responses.create(model="SmolLM2-135M-Instruct", input="FORCE-OBJECT",
                                    tools=[WEATHER_TOOL],
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert [(i.type, i.arguments) for i in named.output] == [
        ("function_call", '{"city": "Paris"}')]
    required = client.responses.create(model="SmolLM2-135M-Instruct", input="FORCE-ARRAY",
                                       tools=[WEATHER_TOOL], tool_choice="required")
    assert [json.loads(i.arguments) for i in required.output] == [{"city": "Paris"}]


def test_instructions_and_leading_developer_items_make_one_system_message(served):
    gw, worker = served
    httpx.post(gw.url + "/v1/responses", timeout=10, json={
        "instructions": "Rule one.", "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "Rule two."}]},
            {"type": "message", "role": "developer", "content": "Rule three."},
            {"type": "message", "role": "user", "content": "hi"}]})
    prompt = prompt_text(worker.submits[-1].prompt_token_ids)
    assert prompt.count("system\n") == 1  # (the special tokens are not in prompt_text)
    assert prompt.index("Rule one.") < prompt.index("Rule two.") < prompt.index("Rule three.")


def test_hosted_tools_are_dropped_and_namespaces_offered(served):
    gw, worker = served
    body = httpx.post(gw.url + "/v1/responses", timeout=10, json={
        "input": "Weather?", "tools": [
            {"type": "web_search"}, {"type": "image_generation"},
            {"type": "mcp", "server_label": "x", "server_url": "https://x"},
            {"type": "namespace", "name": "weather", "description": "Weather tools",
             "tools": [WEATHER_TOOL]}]}).json()
    call = body["output"][-1]
    assert call["type"] == "function_call" and call["namespace"] == "weather"
    prompt = prompt_text(worker.submits[-1].prompt_token_ids)
    assert "get_weather" in prompt and "web_search" not in prompt


def test_text_format_json_schema_reaches_the_worker(served):
    gw, worker = served
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = httpx.post(gw.url + "/v1/responses", timeout=10, json={
        "input": "json", "text": {"format": {"type": "json_schema", "name": "x",
                                             "schema": schema}}})
    assert r.status_code == 200
    assert json.loads(worker.submits[-1].grammar[1]) == schema


# --- stored responses ------------------------------------------------------------------------

def test_retrieve_delete_and_input_items(served):
    gw, _ = served
    created = httpx.post(gw.url + "/v1/responses", json={"input": "hi"}, timeout=10).json()
    url = gw.url + "/v1/responses/" + created["id"]
    assert httpx.get(url).json() == created
    items = httpx.get(url + "/input_items").json()
    assert items["object"] == "list" and items["data"][0]["content"] == "hi"
    assert httpx.delete(url).json() == {"id": created["id"], "object": "response",
                                        "deleted": True}
    missing = httpx.get(url)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    follow = httpx.post(gw.url + "/v1/responses", json={
        "input": "more", "previous_response_id": created["id"]})
    assert follow.status_code == 404
    assert follow.json()["error"]["param"] == "previous_response_id"


def test_store_false_is_not_kept(served):
    gw, _ = served
    created = httpx.post(gw.url + "/v1/responses", json={"input": "hi", "store": False},
                         timeout=10).json()
    assert created["store"] is False
    assert httpx.get(gw.url + "/v1/responses/" + created["id"]).status_code == 404


def test_a_key_reads_only_its_own_responses(tmp_path):
    with GatewayServer(api_keys=("key-a", "key-b"), responses_dir=str(tmp_path)) as gw:
        worker = gw.worker(reply=agent_reply).start()
        assert worker.ready.wait(5)
        a = {"Authorization": "Bearer key-a"}
        b = {"Authorization": "Bearer key-b"}
        created = httpx.post(gw.url + "/v1/responses", json={"input": "hi"}, headers=a,
                             timeout=10).json()
        url = gw.url + "/v1/responses/" + created["id"]
        assert httpx.get(url, headers=a).status_code == 200
        assert httpx.get(url, headers=b).status_code == 404
        assert httpx.delete(url, headers=b).status_code == 404
        follow = httpx.post(gw.url + "/v1/responses", headers=b, json={
            "input": "x", "previous_response_id": created["id"]})
        assert follow.status_code == 404
        worker.stop()


def test_the_store_is_bounded(tmp_path):
    with GatewayServer(responses_dir=str(tmp_path), response_store_size=2) as gw:
        worker = gw.worker(reply=agent_reply).start()
        assert worker.ready.wait(5)
        ids = [httpx.post(gw.url + "/v1/responses", json={"input": "hi"}, timeout=10).json()["id"]
               for _ in range(3)]
        found = [httpx.get(gw.url + "/v1/responses/" + i).status_code for i in ids]
        assert found == [404, 200, 200]
        r = httpx.post(gw.url + "/v1/responses", json={"input": "x",
                                                        "previous_response_id": ids[0]})
        assert r.status_code == 404 and "newest 2" in r.json()["error"]["message"]
        worker.stop()


def test_only_what_is_rendered_is_stored_and_privately(tmp_path):
    """Issue 35, item 6: a reasoning item's encrypted_content and fields the server does not
    read were stored as sent (a 7 MB item, a 7.3 MB file of mode 644, for 22 tokens)."""
    folder = tmp_path / "responses"
    with GatewayServer(reasoning_parser="qwen3", responses_dir=str(folder)) as gw:
        worker = gw.worker(reply=agent_reply).start()
        assert worker.ready.wait(5)
        junk = "j" * 100_000
        body = {"input": [
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "e" * 1_000_000},
            {"type": "message", "role": "user", "junk": junk,
             "content": [{"type": "input_text", "text": "Weather?", "junk": junk}]}]}
        created = httpx.post(gw.url + "/v1/responses", json=body, timeout=10)
        assert created.status_code == 200, created.text
        items = httpx.get(gw.url + f"/v1/responses/{created.json()['id']}/input_items").json()
        assert [i["type"] for i in items["data"]] == ["message"]
        assert items["data"][0]["content"] == [{"type": "input_text", "text": "Weather?"}]
        follow = httpx.post(gw.url + "/v1/responses", timeout=10, json={
            "input": "And tomorrow?", "previous_response_id": created.json()["id"]})
        assert follow.status_code == 200
        assert "Weather?" in prompt_text(worker.submits[-1].prompt_token_ids)
        worker.stop()
    files = list(folder.iterdir())
    assert sum(f.stat().st_size for f in files) < 200_000
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)


def test_a_turn_keeps_its_history_when_its_predecessor_is_deleted_while_it_runs(tmp_path):
    """Issue 35, item 14: the predecessor deleted while the next turn generates; the turn
    after that still sees the whole conversation."""
    with GatewayServer(reasoning_parser="qwen3", responses_dir=str(tmp_path)) as gw:
        worker = gw.worker(reply=agent_reply).start()
        assert worker.ready.wait(5)
        first = httpx.post(gw.url + "/v1/responses", json={"input": "FIRST-TURN"},
                           timeout=10).json()
        worker.is_stepping = False  # the next turn waits in the worker
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            second = pool.submit(httpx.post, gw.url + "/v1/responses", timeout=10, json={
                "input": "SECOND-TURN", "previous_response_id": first["id"]})
            assert wait_until(lambda: len(worker.submits) == 2)
            deleted = httpx.delete(gw.url + "/v1/responses/" + first["id"])
            assert deleted.status_code == 200
            worker.is_stepping = True
            second = second.result()
        assert second.status_code == 200, second.text
        third = httpx.post(gw.url + "/v1/responses", timeout=10, json={
            "input": "THIRD-TURN", "previous_response_id": second.json()["id"]})
        assert third.status_code == 200, third.text
        prompt = prompt_text(worker.submits[-1].prompt_token_ids)
        assert "FIRST-TURN" in prompt and "SECOND-TURN" in prompt
        items = httpx.get(gw.url + f"/v1/responses/{second.json()['id']}/input_items")
        assert [i.get("content") for i in items.json()["data"]][0] == "FIRST-TURN"
        worker.stop()


def test_input_tokens_counts_what_create_sends(served):
    gw, worker = served
    body = {"input": "Weather?", "instructions": "Be brief.", "tools": [WEATHER_TOOL]}
    count = httpx.post(gw.url + "/v1/responses/input_tokens", json=body).json()
    assert count["object"] == "response.input_tokens"
    httpx.post(gw.url + "/v1/responses", json=body, timeout=10)
    assert count["input_tokens"] == len(worker.submits[-1].prompt_token_ids)


# --- hostile bodies --------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [5]}, "input[0]"),
    ({"input": [{"type": "message", "role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "bogus"}]}, "input[0].type"),
    ({"input": "x", "instructions": 5}, "instructions"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"input": "x", "temperature": 9}, "temperature"),
    ({"input": "x", "top_p": 0}, "top_p"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "stream": "yes"}, "stream"),
    ({"input": "x", "metadata": {"k": 5}}, "metadata"),
    ({"input": "x", "metadata": [1]}, "metadata"),
    ({"input": "x", "include": "all"}, "include"),
    ({"input": "x", "tools": {"type": "function"}}, "tools"),
    ({"input": "x", "tools": [5]}, "tools[0]"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, None),
    ({"input": "x", "tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "tools": [WEATHER_TOOL],
      "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "truncation": "middle"}, "truncation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "previous_response_id": 7}, "previous_response_id"),
    ({"input": "x", "previous_response_id": "../../etc/passwd"}, "previous_response_id"),
    ({"input": "x", "model": "gpt-7"}, "model"),
    ({"input": "x", "n": 2}, "n"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]},
     "input[0].output"),
    ({"input": [{"type": "function_call", "name": "f", "call_id": "c", "arguments": {}}]},
     "input[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    # An earlier call's arguments nested past the JSON depth bound (gateway/text/bounded_json).
    ({"input": [{"type": "function_call", "name": "f", "call_id": "c",
                 "arguments": "[" * 5000 + "]" * 5000}]}, "input"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": "no"}]},
     "tools[0]"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [3]}]},
     "tools[0].tools[0]"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "strict": "yes"}]},
     "tools[0].strict"),
    ({"input": "x", "tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1]"),
    ({"input": "x", "tools": [WEATHER_TOOL], "tool_choice": {
        "type": "allowed_tools", "mode": "always", "tools": []}}, "tool_choice.mode"),
    ({"input": "x", "tools": [WEATHER_TOOL], "tool_choice": {"type": "web_search"}},
     "tool_choice"),
    ({"input": "x", "text": "json"}, "text"),
    ({"input": "x", "text": {"format": "json"}}, "text.format"),
    ({"input": "x", "reasoning": "high"}, "reasoning"),
    ({"input": "x", "reasoning": {"summary": "everything"}}, "reasoning.summary"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "top_logprobs": 50}, "top_logprobs"),
    ({"input": "x", "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"input": "x", "service_tier": "gold"}, "service_tier"),
    ({"input": "x", "parallel_tool_calls": "x" * 1000}, "parallel_tool_calls"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "n", "description": "d" * 5000,
                               "tools": []}]}, "tools[0].description"),
    ({"input": "x", "max_tool_calls": "many"}, "max_tool_calls"),
    ({"input": "x", "tools": [{"type": "web_search"}] * 129}, "tools"),
    ({"input": "x", "tools": [{"type": "w" * 200}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "n" * 200, "tools": []}]},
     "tools[0].name"),
])
def test_malformed_bodies_are_4xx(served, body, param):
    gw, _ = served
    r = httpx.post(gw.url + "/v1/responses", json=body, timeout=10)
    assert 400 <= r.status_code < 500, (body, r.text)
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/responses/input_tokens"])
@pytest.mark.parametrize("body", [
    {"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [
        {"type": "function", "name": ["f"]}]}]},
    {"input": "x", "tools": [WEATHER_TOOL], "tool_choice": {"type": "allowed_tools",
                                                            "tools": 5}},
    {"input": "x", "tools": [WEATHER_TOOL], "tool_choice": {"type": "allowed_tools",
                                                            "tools": [{"name": []}]}},
])
def test_odd_tool_shapes_are_4xx_on_both_endpoints(served, path, body):
    gw, _ = served
    r = httpx.post(gw.url + path, json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b'"x"', b"null", b'{"input": "\\ud800"}'])
def test_broken_json_is_4xx(served, raw):
    gw, _ = served
    r = httpx.post(gw.url + "/v1/responses", content=raw,
                   headers={"Content-Type": "application/json"})
    assert 400 <= r.status_code < 500 and "error" in r.json()


def test_context_length_is_a_4xx_with_openais_code(served):
    gw, _ = served
    r = httpx.post(gw.url + "/v1/responses", json={"input": "x" * 5000}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_unknown_ids_are_404(served):
    gw, _ = served
    for rid in ("resp_" + "0" * 32, "nope", "..%2F..%2Fx"):
        assert httpx.get(gw.url + "/v1/responses/" + rid).status_code == 404
        assert httpx.delete(gw.url + "/v1/responses/" + rid).status_code == 404


def test_metrics_count_requests_by_endpoint(served):
    gw, _ = served
    httpx.post(gw.url + "/v1/responses", json={"input": "hi"}, timeout=10)
    httpx.post(gw.url + "/v1/chat/completions", timeout=10,
               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    text = httpx.get(gw.url + "/metrics").text
    assert 'zeroserve:api_requests_total{endpoint="responses"' in text
    assert 'zeroserve:api_requests_total{endpoint="chat"' in text


def test_a_failed_stream_ends_with_response_failed(served):
    gw, worker = served
    worker.num_submits_to_refuse = 5  # more than the one retry a refused SUBMIT gets
    try:
        events = stream_events(gw, {"input": "hi"})
    finally:
        worker.num_submits_to_refuse = 0
    assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                           "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["error"]["message"]


def test_a_bug_rendering_a_stream_ends_it_with_response_failed(served, monkeypatch):
    """A stream that fails on an unexpected exception ends as a failure the client can read
    (chat: a server_error event and [DONE]); a Responses stream's is response.failed."""
    original = ResponsesStream.render

    def render(self, batch):
        if any("H" in update.text for update, _ in batch):  # the answer's "Hello there."
            raise RuntimeError("a bug in one stream's rendering")
        return original(self, batch)

    monkeypatch.setattr(ResponsesStream, "render", render)
    gw, _ = served
    events = stream_events(gw, {"input": "hi"})
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.failed" and "response.completed" not in types
    assert events[-1]["response"]["error"]["code"] == "server_error"


def test_a_follow_up_finds_the_response_on_another_gateway_of_the_tier(tmp_path):
    """Two gateways sharing the tier's folder (as `serve --gateways 2` sets it up): a
    response made on one is found by a follow-up, GET and DELETE on the other."""
    with GatewayServer(responses_dir=str(tmp_path)) as one, \
            GatewayServer(responses_dir=str(tmp_path)) as two:
        workers = [gw.worker(reply=agent_reply).start() for gw in (one, two)]
        assert all(w.ready.wait(5) for w in workers)
        created = httpx.post(one.url + "/v1/responses", json={"input": "Weather in Oslo?"},
                             timeout=10).json()
        follow = httpx.post(two.url + "/v1/responses", timeout=10, json={
            "input": "And tomorrow?", "previous_response_id": created["id"]})
        assert follow.status_code == 200
        assert "Weather in Oslo?" in prompt_text(workers[1].submits[-1].prompt_token_ids)
        assert httpx.get(two.url + "/v1/responses/" + created["id"]).json() == created
        assert httpx.delete(two.url + "/v1/responses/" + created["id"]).status_code == 200
        assert httpx.get(one.url + "/v1/responses/" + created["id"]).status_code == 404
        for w in workers:
            w.stop()


def test_a_codex_shaped_request_streams(served):
    """The fields Codex CLI 0.171 sends (captured from it): developer items, function and
    namespace tools beside web_search, store false, encrypted reasoning asked for, client
    metadata; its earlier turns' reasoning items come back with encrypted content."""
    gw, worker = served
    body = {
        "model": "SmolLM2-135M-Instruct", "stream": True, "tool_choice": "auto",
        "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "session-1",
        "client_metadata": {"x-codex-installation-id": "x"},
        "tools": [
            {"type": "function", "name": "exec_command", "description": "Run a command",
             "strict": False, "parameters": {"type": "object", "properties": {
                 "cmd": {"type": "string"}}, "required": ["cmd"],
                 "additionalProperties": False}},
            {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents",
             "tools": [{"type": "function", "name": "spawn_agent", "strict": False,
                        "parameters": {"type": "object", "properties": {}}}]},
            {"type": "web_search", "external_web_access": False}],
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "You are Codex."}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Say hello"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "encrypted_content": "opaque"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Hello."}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Again"}]}]}
    with httpx.stream("POST", gw.url + "/v1/responses", json=body, timeout=10,
                      headers={"session-id": "session-1"}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("event: ")]
    assert lines[0] == "event: response.created" and lines[-1] == "event: response.completed"
    prompt = prompt_text(worker.submits[-1].prompt_token_ids)
    assert "exec_command" in prompt and "spawn_agent" in prompt and "opaque" not in prompt


def test_the_routing_key_is_the_cache_key_or_a_session_header():
    from starlette.requests import Request

    from zeroserve.gateway.api.responses_request import parse_responses
    from zeroserve.gateway.http.responses_routes import cache_key_of

    def request(*headers: tuple[bytes, bytes]) -> Request:
        return Request({"type": "http", "headers": list(headers)})

    names = ("m",)
    keyed = parse_responses({"input": "x", "prompt_cache_key": "k"}, names)
    plain = parse_responses({"input": "x"}, names)
    by_key = cache_key_of(keyed, request((b"session-id", b"s")))
    assert by_key == cache_key_of(plain, request((b"session-id", b"k")))
    by_session = cache_key_of(plain, request((b"session-id", b"s")))
    assert by_session == cache_key_of(plain, request((b"session_id", b"s"))) != by_key
    assert cache_key_of(plain, request()) is None


def test_the_routing_key_is_a_short_digest_made_once():
    """The router hashes the key with every worker's id on every pick (issue 35, item 8):
    what reaches it is a fixed-size digest, however long the name the client sent."""
    from starlette.requests import Request

    from zeroserve.gateway.api.responses_request import parse_responses
    from zeroserve.gateway.http.responses_routes import cache_key_of

    long_name = "c" * 512  # the longest prompt_cache_key accepted
    req = parse_responses({"input": "x", "prompt_cache_key": long_name}, ("m",))
    assert len(cache_key_of(req, Request({"type": "http", "headers": []}))) == 32
    header = Request({"type": "http", "headers": [(b"session-id", b"h" * 8000)]})
    assert len(cache_key_of(parse_responses({"input": "x"}, ("m",)), header)) == 32


def test_long_free_text_fields_are_400(served):
    gw, _ = served
    for field, limit in (("prompt_cache_key", 512), ("user", 512), ("safety_identifier", 64)):
        ok = httpx.post(gw.url + "/v1/responses", timeout=10,
                        json={"input": "hi", field: "k" * limit})
        assert ok.status_code == 200 and ok.json()[field] == "k" * limit
        r = httpx.post(gw.url + "/v1/responses", timeout=10,
                       json={"input": "hi", field: "k" * (limit + 1)})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert f"at most {limit} characters" in r.json()["error"]["message"]


def test_the_response_repeats_only_what_it_reads(served):
    """Unknown keys of tools, reasoning and text are not echoed (nor stored); a hosted tool
    this server drops is echoed as sent when small, and refused when large (issue 35, 7)."""
    gw, _ = served
    junk = "j" * 10_000
    hosted = {"type": "web_search", "search_context_size": "low"}
    body = {"input": "hi", "tools": [WEATHER_TOOL | {"junk": junk}, hosted],
            "reasoning": {"effort": "low", "junk": junk},
            "text": {"format": {"type": "text", "junk": junk}},
            "tool_choice": {"type": "allowed_tools", "mode": "auto",
                            "tools": [{"type": "function", "name": "get_weather",
                                       "junk": junk}]}}
    created = httpx.post(gw.url + "/v1/responses", json=body, timeout=10)
    assert created.status_code == 200, created.text
    assert "junk" not in created.text
    assert created.json()["tools"] == [WEATHER_TOOL, hosted]
    assert created.json()["reasoning"] == {"effort": "low"}
    stored = httpx.get(gw.url + "/v1/responses/" + created.json()["id"])
    assert stored.status_code == 200 and "junk" not in stored.text
    big = {"type": "web_search", "filters": {"allowed_domains": ["x" * 20_000]}}
    r = httpx.post(gw.url + "/v1/responses", json={"input": "hi", "tools": [big]}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0]"
    assert "bytes as JSON" in r.json()["error"]["message"]


def test_a_streamed_response_continues_on_the_restarted_worker():
    """Chat's failover, reused: the worker dies mid-stream, the response goes on from where
    it stopped on the new one, and the client sees one whole text and response.completed."""
    from tests.gateway.helpers import cyclic_reply

    with GatewayServer() as gw:
        worker = gw.worker(reply=cyclic_reply("abc"), step_s=0.01).start()
        assert worker.ready.wait(5)
        with httpx.stream("POST", gw.url + "/v1/responses", timeout=10, json={
                "input": "x", "max_output_tokens": 300, "stream": True}) as r:
            lines = r.iter_lines()
            events = []
            for line in lines:
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1]["type"] == "response.output_text.delta":
                        break
            worker.stop()
            worker2 = gw.worker(reply=cyclic_reply("abc")).start()
            events += [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
        worker2.stop()
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "abc" * 100
    assert events[-1]["type"] == "response.incomplete"  # (max_output_tokens reached)
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == text
    assert 0 < len(worker2.submits[0].output_token_ids) < 300


def test_rate_limits_cover_responses():
    with GatewayServer(rate_limit_rps=0.01, rate_limit_burst=1) as gw:
        worker = gw.worker(reply=agent_reply).start()
        assert worker.ready.wait(5)
        first = httpx.post(gw.url + "/v1/responses", json={"input": "hi"}, timeout=10)
        second = httpx.post(gw.url + "/v1/responses", json={"input": "hi"}, timeout=10)
        worker.stop()
    assert first.status_code == 200
    assert second.status_code == 429 and "Retry-After" in second.headers
    assert second.json()["error"]["code"] == "rate_limit_exceeded"
