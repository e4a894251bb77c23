"""SUBMIT's grammar and TokenOutput's prompt_logprobs: optional (older peers omit them), and
checked on decode."""

from __future__ import annotations

import msgpack
import pytest

from zeroserve.common.protocol import (
    MAX_GRAMMAR_CHARS,
    ProtocolError,
    Submit,
    TokenOutput,
    Tokens,
    decode,
    encode,
)


def roundtrip(msg: Submit) -> Submit:
    return decode(encode(msg))


def test_grammar_travels_and_is_optional():
    msg = Submit("r", [1, 2], {"max_tokens": 4}, 8, [], ["json_schema", '{"type":"object"}'])
    assert roundtrip(msg).grammar == ["json_schema", '{"type":"object"}']
    assert roundtrip(Submit("r", [1], {}, 8)).grammar is None
    # A sender that predates the field (five fields) still decodes.
    frames = [encode(Submit("r", [1], {}, 8))[0],
              msgpack.packb(["r", [1], {}, 8, []], use_bin_type=True)]
    assert decode(frames).grammar is None


@pytest.mark.parametrize("grammar", [
    ["cfg", "x"], ["regex"], ["regex", ""], ["regex", 5], "regex",
    ["regex", "a" * (MAX_GRAMMAR_CHARS + 1)], ["regex", "a", "b"],
])
def test_bad_grammars_are_refused_on_decode(grammar):
    frames = encode(Submit("r", [1], {}, 8))
    body = msgpack.packb(["r", [1], {}, 8, [], grammar], use_bin_type=True)
    with pytest.raises(ProtocolError):
        decode([frames[0], body])


def test_prompt_logprobs_travel_in_token_outputs():
    row = TokenOutput.wire_row("r", [5], None, 3, 1, 0, None, None, None,
                               [[-1.5, [[7, -0.5]]], [-2.0, []]])
    [out] = decode(encode(Tokens("w", 1, [row]))).outputs
    assert out.prompt_logprobs == [[-1.5, [[7, -0.5]]], [-2.0, []]]
    [old] = decode(encode(Tokens("w", 1, [row[:9]]))).outputs  # a worker before the field
    assert old.prompt_logprobs is None
    with pytest.raises(ProtocolError):
        decode(encode(Tokens("w", 1, [row[:9] + ["not a list"]])))
