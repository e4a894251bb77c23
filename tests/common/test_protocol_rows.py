"""TOKENS outputs in wire form (TokenOutput.wire_row, the worker's per-step fast path) encode
exactly as TokenOutput objects do and decode to the same outputs."""

from __future__ import annotations

import random

import msgpack
import pytest

from zeroserve.common.protocol import MsgType, ProtocolError, TokenOutput, Tokens, decode, encode


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


# Hostile values for each place of the usual 11-item row (a running stream's tokens).
_HOSTILE = [None, True, False, -1, 0, 1, 2**32 - 1, 2**32, 2**40, 1.0, float("nan"), "x", "",
            b"x", [], [1], [True], [1.0], ["1"], [None], [1, "x"], {}, [0.5, 0.25],
            "stop", "length", "done", [[-0.5, [[7, -0.5]]]]]


def _outcome(parse, row):
    try:
        return parse(list(row))
    except ProtocolError as e:
        return ("refused", type(e))


def test_the_usual_rows_short_check_accepts_and_refuses_as_the_full_checks_do():
    """from_wire checks the usual row in one test and leaves everything else to the full
    checks: over every place of the row and hostile values in it, it gives the same
    output, or the same refusal, as the full checks alone."""
    usual = ["req-1", [5, 6], None, 3, 2, 0, None, None, None, None, 1]
    rng = random.Random(36)
    rows = [usual]
    for place in range(len(usual)):
        for value in _HOSTILE:
            rows.append([*usual[:place], value, *usual[place + 1:]])
    for _ in range(3000):  # two or three places at once
        row = list(usual)
        for place in rng.sample(range(len(usual)), rng.randrange(2, 4)):
            row[place] = rng.choice(_HOSTILE)
        rows.append(row)
    num_refused = 0
    for row in rows:
        fast, full = _outcome(TokenOutput.from_wire, row), _outcome(
            TokenOutput._from_wire_checked, row)
        assert fast == full, row
        num_refused += isinstance(full, tuple)
    assert 0 < num_refused < len(rows)  # both kinds were exercised


def test_usual_rows_with_a_hostile_place_are_refused_on_decode():
    usual = ["r", [5], None, 3, 2, 0, None, None, None, None, 1]
    for place, value in [(0, 5), (1, [True]), (1, [1.0]), (1, "x"), (3, -1), (4, True),
                         (5, 1.5), (10, 2**32), (10, -1), (2, "done"), (6, {}), (7, 5)]:
        row = [*usual[:place], value, *usual[place + 1:]]
        with pytest.raises(ProtocolError):
            decode([bytes([MsgType.TOKENS]), msgpack.packb(["w", 1, [row]])])
