"""Stop strings across piece boundaries: trimmed output, nothing leaked early."""

from __future__ import annotations

import pytest

from zeroserve.gateway.text.stop_strings import StopStringMatcher


def run(stops, pieces):
    m = StopStringMatcher(stops)
    out = []
    for p in pieces:
        out.append(m.push(p))
        if m.is_stopped:
            return out, True
    out.append(m.flush())
    return out, False


def test_stop_inside_one_piece():
    out, stopped = run(["END"], ["abc END xyz"])
    assert stopped and "".join(out) == "abc "


def test_stop_across_pieces_is_trimmed_and_never_leaked():
    out, stopped = run(["\n\nUser:"], ["Hello", "\n", "\nUs", "er", ": more"])
    assert stopped
    assert "".join(out) == "Hello"
    assert all("\n" not in piece for piece in out)  # the stop's start was held back


def test_false_start_is_released():
    out, stopped = run(["STOP"], ["ST", "OP?", " no"])
    assert stopped and "".join(out) == ""
    out, stopped = run(["STOP"], ["ST", "ART", " ok"])
    assert not stopped and "".join(out) == "START ok"


def test_held_tail_is_released_at_the_end():
    out, stopped = run(["###"], ["value #", "#"])
    assert not stopped and "".join(out) == "value ##"


def test_earliest_of_several_stops_wins():
    out, stopped = run(["b", "xyz"], ["axyzb"])
    assert stopped and "".join(out) == "a"


@pytest.mark.parametrize("split", range(1, 12))
def test_every_split_point(split):
    text = "one two<|end|>three"
    out, stopped = run(["<|end|>"], [text[:split], text[split:]])
    assert stopped and "".join(out) == "one two"


def test_no_stops_passes_through():
    m = StopStringMatcher([])
    assert m.push("abc") == "abc" and not m.is_stopped
