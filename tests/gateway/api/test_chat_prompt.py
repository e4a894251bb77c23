"""The chat prompt as the model gets it: /tokenize renders exactly what /v1/chat/completions
submits (tools, template options), and continue_final_message leaves the final assistant
message open."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from tests.gateway.helpers import IM_END, IM_START, GatewayServer, byte_tokenizer, text_tokens
from zeroserve.gateway.text.chat_template import ChatTemplate

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
HI = [{"role": "user", "content": "What is the weather in Paris?"}]
PARTIAL = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}

# ChatML that reads `tools` and a template argument, as Qwen-style templates do.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% if greeting %}<|im_start|>system\n{{ greeting }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def serve(chat_template: str | None = None):
    """A gateway (with the given template, else the fallback ChatML) and one ready worker."""
    tokenizer = byte_tokenizer()
    if chat_template is not None:
        tokenizer = replace(tokenizer, chat_template=chat_template)
    gw = GatewayServer(tokenizer=tokenizer)
    gw.__enter__()
    worker = gw.worker().start()
    assert worker.ready.wait(5)
    return gw, worker


@pytest.fixture(params=[None, TOOLS_TEMPLATE], ids=["tools-as-system-prompt", "tools-template"])
def served(request):
    gw, worker = serve(request.param)
    yield gw, worker
    worker.stop()
    gw.__exit__(None, None, None)


def chat_prompt_ids(gw, worker, body: dict) -> list[int]:
    """The prompt ids the worker got for this chat request (and usage agrees)."""
    r = httpx.post(gw.url + "/v1/chat/completions", json={**body, "max_tokens": 3})
    assert r.status_code == 200, r.text
    ids = worker.submits[-1].prompt_token_ids
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    return ids


def tokenize(gw, body: dict) -> dict:
    r = httpx.post(gw.url + "/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("extra", [
    {"tools": [WEATHER]},
    {"tools": [WEATHER], "tool_choice": "required"},
    {"tools": [WEATHER], "tool_choice": "none"},
    {"tools": [WEATHER], "chat_template_kwargs": {"greeting": "Be brief."}},
], ids=["auto", "required", "none", "template-kwargs"])
def test_tokenize_counts_the_chat_prompt(served, extra):
    gw, worker = served
    body = {"messages": HI, **extra}
    ids = chat_prompt_ids(gw, worker, body)
    tok = tokenize(gw, body)
    assert tok["tokens"] == ids and tok["count"] == len(ids)
    if extra.get("tool_choice") != "none":  # the tools are in the prompt, not dropped
        assert tok["count"] > tokenize(gw, {"messages": HI})["count"] + 50


def test_tokenize_counts_earlier_tool_calls(served):
    """Earlier calls and results are written into the prompt as chat writes them."""
    gw, worker = served
    messages = HI + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = {"messages": messages, "tools": [WEATHER]}
    assert tokenize(gw, body)["tokens"] == chat_prompt_ids(gw, worker, body)


@pytest.mark.parametrize("tools", [
    [{"type": "function", "function": {"name": "bad name!"}}],
    [{"type": "nope"}],
    [WEATHER, WEATHER],
])
def test_tokenize_rejects_bad_tools_as_chat_does(served, tools):
    gw, _ = served
    body = {"messages": HI, "tools": tools}
    chat = httpx.post(gw.url + "/v1/chat/completions", json=body)
    tok = httpx.post(gw.url + "/tokenize", json=body)
    assert chat.status_code == tok.status_code == 400
    assert tok.json()["error"]["param"] == chat.json()["error"]["param"]


def test_continue_final_message_leaves_the_turn_open(served):
    gw, worker = served
    body = {"messages": PARTIAL, **CONTINUE}
    expected = ([IM_START] + text_tokens("user\nhi") + [IM_END] + text_tokens("\n")
                + [IM_START] + text_tokens("assistant\nSure, "))
    assert chat_prompt_ids(gw, worker, body) == expected  # no <|im_end|> after "Sure, "
    assert tokenize(gw, body)["tokens"] == expected
    # Without it, the assistant's turn is closed as before.
    closed = tokenize(gw, {"messages": PARTIAL, "add_generation_prompt": False})["tokens"]
    assert closed == expected + [IM_END] + text_tokens("\n")


@pytest.mark.parametrize("body", [
    {"messages": PARTIAL, "continue_final_message": True, "add_generation_prompt": True},
    {"messages": PARTIAL, "continue_final_message": True},  # add_generation_prompt's default
    {"messages": HI, **CONTINUE},  # the final message is the user's
], ids=["both-true", "default-generation-prompt", "final-not-assistant"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_continue_final_message_mistakes(served, body, path):
    gw, worker = served
    r = httpx.post(gw.url + path, json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "continue_final_message"
    assert not worker.submits


def test_continue_final_message_is_not_a_template_kwarg(served):
    gw, _ = served
    r = httpx.post(gw.url + "/v1/chat/completions", json={
        "messages": PARTIAL, "chat_template_kwargs": {"continue_final_message": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


# --- the template alone -------------------------------------------------------------------

@pytest.mark.parametrize("content", ["", "m", "hi"],
                         ids=["empty", "in-the-end-marker", "same-as-earlier-message"])
def test_open_render_cuts_at_the_final_content(content):
    """The cut is where the final message's content ends, even when that content is empty
    or its text also appears earlier or in what the template writes after it."""
    template = ChatTemplate(None)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]
    text = template.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" + content


def test_open_render_refuses_a_template_that_drops_the_content():
    template = ChatTemplate("{% for m in messages %}{{ m['role'] }}\n{% endfor %}")
    with pytest.raises(ValueError, match="continue_final_message"):
        template.render([{"role": "assistant", "content": "x"}], add_generation_prompt=False,
                        continue_final_message=True)
