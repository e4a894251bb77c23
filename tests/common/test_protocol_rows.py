"""TOKENS outputs in wire form (TokenOutput.wire_row, the worker's per-step fast path) encode
exactly as TokenOutput objects do and decode to the same outputs."""

from __future__ import annotations

from zeroserve.common.protocol import TokenOutput, Tokens, decode, encode


def test_wire_rows_encode_like_token_outputs():
    objects = [TokenOutput("a", [5, 6], None, 3, 2),
               TokenOutput("b", [], "length", 4, 9, 2, [[-0.5, [[7, -0.5]]]], None, [0.1, 0.2]),
               TokenOutput("c", [], "error", 1, 0, 0, None, "bad request")]
    rows = [TokenOutput.wire_row(o.request_id, o.new_token_ids, o.finish_reason,
                                 o.num_prompt_tokens, o.num_output_tokens, o.num_cached_tokens,
                                 o.logprobs, o.error, o.timings) for o in objects]
    assert encode(Tokens("w", 7, rows)) == encode(Tokens("w", 7, objects))
    # A mix (the worker's rejections are objects, its step outputs rows) decodes as objects.
    decoded = decode(encode(Tokens("w", 7, [objects[0], *rows[1:]])))
    assert decoded.outputs == objects
