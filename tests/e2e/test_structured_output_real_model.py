"""JSON schemas and tool calls through the whole system with the real default model.

SmolLM2-135M on its own rarely answers in the shape asked for; constrained decoding must make
every answer parse and match the schema, and a required tool a valid call, through the
official `openai` client, streaming and not.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

MAX_TOKENS = 80

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["engineer", "doctor", "teacher"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                             "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}


def matches(value, schema: dict) -> bool:
    """The subset of JSON Schema these tests use, checked independently of the server."""
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return (type(value) is int and schema.get("minimum", value) <= value
                <= schema.get("maximum", value))
    if kind == "object":
        props = schema.get("properties", {})
        if not isinstance(value, dict) or not set(schema.get("required", ())) <= set(value):
            return False
        if schema.get("additionalProperties") is False and not set(value) <= set(props):
            return False
        return all(matches(v, props[k]) for k, v in value.items() if k in props)
    return True


@pytest.fixture(scope="module")
def client(real_model_server):
    server = real_model_server  # the session's (tests/e2e/conftest.py)
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_json_schema_answers_parse_and_match(client):
    for question, temperature in [("Tell me about a person.", 0.0),
                                  ("Invent a character for a story.", 1.0)]:
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=ask(question), max_tokens=MAX_TOKENS,
            temperature=temperature, seed=3,
            response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON, "strict": True}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        assert matches(json.loads(choice.message.content), PERSON), choice.message.content
        # in the schema's own order, as OpenAI writes them (not sorted: "age" first)
        assert list(json.loads(choice.message.content)) == list(PERSON["properties"])


def test_json_object_streams_one_object(client):
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ask("List three fruits."),
        max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        response_format={"type": "json_object"})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text), dict), text


def test_required_tool_gives_a_valid_call(client):
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ask("What is the weather like in Paris?"),
        tools=[WEATHER, TIME], tool_choice="required", max_tokens=MAX_TOKENS,
        temperature=0.0, parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    assert matches(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("tool_choice,tools,question", [
    ("required", [WEATHER], "What is the weather like in Paris?"),
    ({"type": "function", "function": {"name": "get_weather"}}, [WEATHER, TIME],
     "Is it cold in Oslo?"),
], ids=["required", "named"])
def test_forced_tool_calls_stream_openai_deltas(client, tool_choice, tools, question):
    """The call's name first, then its arguments in fragments as they are generated (for
    "required" the grammar writes "name" before "arguments", so they need not wait)."""
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ask(question), tools=tools,
        tool_choice=tool_choice, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        parallel_tool_calls=False)
    deltas, finish = [], None
    for chunk in stream:
        if chunk.choices:
            deltas += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    first, *rest = deltas
    assert first.id.startswith("call_") and first.function.name == "get_weather"
    assert len(rest) > 1
    assert all(d.index == 0 and d.id is None for d in rest)
    arguments = "".join(d.function.arguments for d in deltas)
    assert matches(json.loads(arguments), WEATHER["function"]["parameters"])


def test_echo_with_logprobs_and_n_sharing_the_prompt(client):
    """echo + logprobs gives the prompt's logprobs first; n choices of one prompt prefill it
    once (the others find its blocks in the prefix cache; usage counts the prompt once)."""
    prompt = ("The following is a list of the planets of the solar system, in order from "
              "the sun, with one fact about each:")
    reply = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt,
                                      max_tokens=4, temperature=0.0, echo=True, logprobs=2)
    choice = reply.choices[0]
    num_prompt = reply.usage.prompt_tokens
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == num_prompt + 4 and "".join(lp.tokens[:num_prompt]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
    story = ("Here is a short story about a lighthouse keeper who finds a message in a "
             "bottle on a stormy night, told in the first person. It begins:")  # uncached
    hits_before = _prefix_cache_hits(client)
    reply = client.completions.create(model="SmolLM2-135M-Instruct", prompt=story,
                                      max_tokens=3, temperature=1.0, seed=5, n=3)
    assert len(reply.choices) == 3
    shared = (reply.usage.prompt_tokens - 1) // 16 * 16  # full blocks of the default size
    details = reply.usage.prompt_tokens_details
    assert details is None or details.cached_tokens == 0  # the prompt was new: computed once
    deadline = time.monotonic() + 10  # the worker's counters come with its heartbeats
    while _prefix_cache_hits(client) - hits_before < 2 * shared and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _prefix_cache_hits(client) - hits_before >= 2 * shared > 0


def test_echo_with_max_tokens_0_scores_the_prompt_and_n_shares_its_logprobs(client):
    """lm-eval's loglikelihood request: echo + logprobs + max_tokens 0 gives the prompt's
    logprobs and no completion; with n = 2 both choices show the same prompt logprobs, which
    the worker computed once (one SUBMIT asked for them)."""
    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    scored = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt,
                                       max_tokens=0, echo=True, logprobs=1)
    [choice] = scored.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == scored.usage.prompt_tokens and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    both = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt,
                                     max_tokens=2, echo=True, logprobs=1, n=2, seed=3)
    num_prompt = len(lp.tokens)
    for c in both.choices:
        assert c.logprobs.tokens[:num_prompt] == lp.tokens
        assert c.logprobs.token_logprobs[1:num_prompt] == pytest.approx(
            lp.token_logprobs[1:], abs=1e-3)
        assert len(c.logprobs.tokens) == num_prompt + 2


def _prefix_cache_hits(client) -> float:
    url = str(client.base_url).removesuffix("/").removesuffix("/v1") + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("zeroserve:prefix_cache_hits_total"))


@pytest.mark.parametrize("tool_choice", [{"type": "any", "disable_parallel_tool_use": True},
                                         {"type": "tool", "name": "get_weather"}],
                         ids=["any", "tool"])
def test_anthropic_forced_tool_use_is_valid(client, tool_choice):
    """The Messages API's forced tools go through the same grammars: the anthropic SDK's
    streamed tool_use block holds input that matches the tool's input_schema."""
    anthropic = pytest.importorskip("anthropic")
    base_url = str(client.base_url).removesuffix("/").removesuffix("/v1")
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]
    with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0,
                             timeout=300) as messages_client:
        with messages_client.messages.stream(
                model="SmolLM2-135M-Instruct", max_tokens=MAX_TOKENS,
                extra_body={"temperature": 0.0},  # (this SDK no longer takes it by name)
                tools=tools, tool_choice=tool_choice,
                messages=ask("What is the weather like in Paris?")) as stream:
            message = stream.get_final_message()
    assert message.stop_reason == "tool_use"
    [block] = message.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    schema = {"get_weather": WEATHER, "get_time": TIME}[block.name]["function"]["parameters"]
    assert matches(block.input, schema), block.input


def test_anthropic_output_config_format_answers_match(client):
    """Anthropic's structured outputs (output_config.format) through the same grammars."""
    anthropic = pytest.importorskip("anthropic")
    base_url = str(client.base_url).removesuffix("/").removesuffix("/v1")
    with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0,
                             timeout=300) as messages_client:
        message = messages_client.messages.create(
            model="SmolLM2-135M-Instruct", max_tokens=MAX_TOKENS,
            messages=ask("Tell me about a person."), extra_body={"temperature": 0.0},
            output_config={"format": {"type": "json_schema", "schema": PERSON}})
    assert message.stop_reason == "end_turn"
    assert matches(json.loads(message.content[0].text), PERSON), message.content[0].text
