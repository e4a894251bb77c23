"""A reasoning model's Messages responses: chat's reasoning parser (text/reasoning.py, per
choice in generation.Choice) splits the <think> text off, and it becomes a `thinking`
block (with its signature) before the text, streamed and not, as chat's reasoning_content."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.helpers import GatewayServer, fixed_reply
from zeroserve.gateway.api.anthropic_messages import parse_messages
from zeroserve.gateway.http.messages import MessageOutput
from zeroserve.gateway.text.reasoning import ReasoningSyntax

REPLY = "<think>\nTwo and two.\n</think>\n\nIt is 4."
BODY = {"model": "SmolLM2-135M-Instruct", "max_tokens": 100,
        "messages": [{"role": "user", "content": "2+2?"}]}


def test_split_pieces_make_a_thinking_block_then_text():
    request = parse_messages({"max_tokens": 9, "messages": [{"role": "user", "content": "x"}]},
                             ("m",))
    output = MessageOutput(None, request, None)
    parser = ReasoningSyntax("qwen3").parser("")
    events = []
    pieces = ["<thi", "nk>Let me", " see.</th", "ink>It", " is 4."]
    for i, piece in enumerate(pieces):
        reasoning, text = parser.push(piece)
        events += output.push(reasoning, text, is_last=i == len(pieces) - 1)
    deltas = [(d["index"], d["delta"]["type"]) for n, d in events if n == "content_block_delta"]
    assert deltas[-3:] == [(0, "signature_delta"), (1, "text_delta"), (1, "text_delta")]
    assert {kind for index, kind in deltas if index == 0} == {"thinking_delta",
                                                               "signature_delta"}
    content = output.builder.content()
    assert content[0]["type"] == "thinking" and content[0]["thinking"] == "Let me see."
    assert content[0]["signature"]
    assert content[1] == {"type": "text", "text": "It is 4."}
    assert [n for n, _ in events][-1] == "content_block_stop"


@pytest.fixture(scope="module")
def thinking():
    with GatewayServer(reasoning_parser="qwen3") as gw:
        worker = gw.worker(reply=fixed_reply(REPLY)).start()
        assert worker.ready.wait(5)
        yield gw
        worker.stop()


def test_thinking_block_then_text_streamed_and_not(thinking):
    message = httpx.post(thinking.url + "/v1/messages", json=BODY, timeout=10).json()
    assert [block["type"] for block in message["content"]] == ["thinking", "text"]
    assert message["content"][0]["thinking"] == "\nTwo and two.\n"
    assert message["content"][1]["text"] == "It is 4."
    assert message["stop_reason"] == "end_turn"

    events = []
    with httpx.stream("POST", thinking.url + "/v1/messages", json=BODY | {"stream": True},
                      timeout=10) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "\nTwo and two.\n"
    assert "".join(d.get("text", "") for d in deltas) == "It is 4."
    assert not any("think>" in json.dumps(d) for d in deltas)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    # One builder for both: the streamed blocks are the message's.
    signature = next(d["signature"] for d in deltas if d["type"] == "signature_delta")
    assert signature == message["content"][0]["signature"]


def test_a_forced_tool_use_is_not_split(thinking):
    """A grammar shapes the whole output (here a forced tool): no thinking to split off,
    as in chat."""
    tool = {"name": "answer", "input_schema": {"type": "object"}}
    r = httpx.post(thinking.url + "/v1/messages", timeout=10, json=BODY | {
        "tools": [tool], "tool_choice": {"type": "tool", "name": "answer"}})
    assert r.status_code == 200, r.text
    assert all(block["type"] != "thinking" for block in r.json()["content"])
