"""Chat completions of a reasoning model: the <think> text in `reasoning_content` and
`reasoning` (message and streamed deltas), reasoning tokens in usage."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.helpers import GatewayServer, fixed_reply

REPLY = "<think>\nTwo and two.\n</think>\n\nIt is 4."
CHAT = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 100}


@pytest.fixture(scope="module")
def thinking():
    with GatewayServer(reasoning_parser="qwen3") as gw:
        worker = gw.worker(reply=fixed_reply(REPLY)).start()
        assert worker.ready.wait(5)
        yield gw
        worker.stop()


def test_message_carries_the_reasoning_apart(thinking):
    body = httpx.post(thinking.url + "/v1/chat/completions", json=CHAT, timeout=10).json()
    message = body["choices"][0]["message"]
    assert message["content"] == "It is 4."
    assert message["reasoning_content"] == message["reasoning"] == "\nTwo and two.\n"
    details = body["usage"]["completion_tokens_details"]
    # One token a byte: "<think>\nTwo and two.\n</think>" are reasoning tokens.
    assert details["reasoning_tokens"] == len(REPLY.encode()) - len("\n\nIt is 4.")


def test_stream_sends_reasoning_deltas_then_content(thinking):
    with httpx.stream("POST", thinking.url + "/v1/chat/completions", timeout=10,
                      json=CHAT | {"stream": True,
                                   "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == "".join(d.get("reasoning", "") for d in deltas) == "\nTwo and two.\n"
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."
    assert not any("think>" in json.dumps(d) for d in deltas)
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


def test_a_grammar_shaped_output_is_not_split(thinking):
    """JSON (or a forced call) is the whole output: no reasoning parsing, even with a
    reasoning model (the grammar leaves it no room to think)."""
    body = httpx.post(thinking.url + "/v1/chat/completions", timeout=10, json=CHAT | {
        "response_format": {"type": "json_object"}}).json()
    message = body["choices"][0]["message"]
    assert message["content"] == REPLY and "reasoning_content" not in message


QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined "
    "and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_a_template_writing_think_picks_the_parser_and_enable_thinking_reaches_it(tmp_path):
    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3_LIKE)
    with GatewayServer(chat_template=str(template)) as gw:  # no --reasoning-parser
        worker = gw.worker(reply=fixed_reply(REPLY)).start()
        assert worker.ready.wait(5)
        body = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10).json()
        off = CHAT | {"chat_template_kwargs": {"enable_thinking": False}}
        prompt = httpx.post(gw.url + "/tokenize", json=off).json()["tokens"]
        worker.stop()
    assert body["choices"][0]["message"]["reasoning_content"] == "\nTwo and two.\n"
    assert bytes(t for t in prompt if t < 256).endswith(b"<think>\n\n</think>\n\n")


def test_without_a_reasoning_model_nothing_changes():
    with GatewayServer() as gw:
        worker = gw.worker(reply=fixed_reply(REPLY)).start()
        assert worker.ready.wait(5)
        body = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10).json()
        worker.stop()
    message = body["choices"][0]["message"]
    assert message["content"] == REPLY and "reasoning_content" not in message
    assert "completion_tokens_details" not in body["usage"]
