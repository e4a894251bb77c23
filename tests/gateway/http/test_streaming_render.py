"""The direct path's renderer (gateway/http/streaming.py StreamedResponse._render_one): a
plain text chunk is built from a template around the new text; whatever the text, the
endpoint and the model's name, its bytes are those `render` makes for the same update."""

from __future__ import annotations

import json

import pytest

from tests.gateway.helpers import byte_tokenizer
from zeroserve.gateway.api.openai_schema import SamplingOptions
from zeroserve.gateway.api.responses import ResponseContext
from zeroserve.gateway.config import GatewayConfig
from zeroserve.gateway.core import Gateway
from zeroserve.gateway.generation import ChoiceUpdate, RequestGroup
from zeroserve.gateway.http import streaming
from zeroserve.gateway.http.streaming import StreamedResponse

TEXTS = ["hello", " world", 'say "hi"', "back\\slash", "line\nbreak\ttab", "\x01\x1f",
         "héllo ✓", "😀", "</script>", "\u2028\u2029", streaming._TEXT_MARK]


def streamed(kind: str, model: str, include_usage: bool, n: int = 1) -> StreamedResponse:
    gateway = Gateway(GatewayConfig())
    tokenizer = byte_tokenizer()
    sampling = SamplingOptions(max_tokens=100, n=n)
    group = RequestGroup(gateway)
    group.prompt_lengths.append(1)
    for i in range(n):
        group.add([65], sampling.worker_params(100, i), tokenizer, (), True)
    ctx = ResponseContext(kind, model, include_usage, id="cmpl-fixed", created_at=1.0)
    return StreamedResponse(gateway, tokenizer, group, ctx, sampling)


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", ["m", 'a "quoted" model ✓', streaming._TEXT_MARK])
def test_a_templated_chunk_is_the_chunk_render_makes(kind, include_usage, model):
    fast = streamed(kind, model, include_usage, n=2)
    slow = streamed(kind, model, include_usage, n=2)
    for index in (0, 1):
        for text in TEXTS + ["", "last"]:
            update = ChoiceUpdate(index, text, [66], None, None)
            chunk = fast._render_one(update)
            assert chunk == slow.render([(update, None)])
            if text:  # each is one well-formed event carrying the text
                events = [e for e in chunk.split(b"\n\n") if e]
                assert json.loads(events[-1][6:])["choices"][0][
                    "text" if kind == "completion" else "delta"] in (text, {"content": text})
    # The text offsets that logprobs count from moved as they do through render.
    assert fast._offsets == slow._offsets


def test_updates_a_template_does_not_cover_go_through_render():
    fast = streamed("chat", "m", True)
    slow = streamed("chat", "m", True)
    updates = [ChoiceUpdate(0, "a", [66], None, None),  # the role chunk comes first
               ChoiceUpdate(0, "b", [66], None, None, reasoning="thinking"),
               ChoiceUpdate(0, "c", [66], [[-0.5, []]], None),  # logprobs
               ChoiceUpdate(0, "d", [66], None, "stop")]
    for update in updates:
        assert fast._render_one(update) == slow.render([(update, None)])


def test_another_apis_stream_renders_its_own_chunks_on_the_direct_path():
    class OtherApiStream(StreamedResponse):  # as http/responses_routes.py, http/messages.py
        def render(self, batch) -> bytes:
            return b"event: other\n" + b"".join(u.text.encode() for u, _ in batch) + b"\n\n"

    plain = streamed("chat", "m", False)
    other = OtherApiStream(plain.gateway, plain.tokenizer, plain.group, plain.ctx,
                           plain.sampling)
    other._needs_role.clear()
    assert other._render_one(ChoiceUpdate(0, "hi", [66], None, None)) == b"event: other\nhi\n\n"
