"""The reasoning seam of a Messages response: a (stateful) split of each update's text into
thinking and answer becomes a thinking block, then the text block, in the stream."""

from __future__ import annotations

from zeroserve.gateway.api.anthropic_messages import parse_messages
from zeroserve.gateway.generation import ChoiceUpdate
from zeroserve.gateway.http.messages import MessageOutput


class ThinkSplit:
    """A toy streaming parser: everything before '</think>' is thinking."""

    def __init__(self):
        self.in_thinking = True

    def __call__(self, text: str, is_last: bool) -> tuple[str, str]:
        if not self.in_thinking:
            return "", text
        thinking, end, rest = text.partition("</think>")
        if end:
            self.in_thinking = False
        return thinking, rest


def test_split_updates_make_a_thinking_block_then_text():
    request = parse_messages({"max_tokens": 9, "messages": [{"role": "user", "content": "x"}]},
                             ("m",))
    output = MessageOutput(None, request, None, split=ThinkSplit())
    events = []
    for text, finish in [("Let me", None), (" see.</think>It", None), (" is 4.", "stop")]:
        events += output.push(ChoiceUpdate(0, text, [1], None, finish))
    deltas = [(d["index"], d["delta"]["type"]) for n, d in events if n == "content_block_delta"]
    assert deltas == [(0, "thinking_delta"), (0, "thinking_delta"), (0, "signature_delta"),
                      (1, "text_delta"), (1, "text_delta")]
    content = output.builder.content()
    assert content[0]["type"] == "thinking" and content[0]["thinking"] == "Let me see."
    assert content[0]["signature"]
    assert content[1] == {"type": "text", "text": "It is 4."}
    assert [n for n, _ in events][-1] == "content_block_stop"
