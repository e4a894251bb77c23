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


def reference(stops, pieces):
    """The definition, by brute force: the text up to the earliest stop string's start;
    a piece's output never holds a character that a stop string could still claim."""
    text = "".join(pieces)
    starts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[:min(starts)], True) if starts else (text, False)


@pytest.mark.parametrize("seed", range(40))
def test_random_pieces_match_the_definition(seed):
    import random

    rng = random.Random(seed)
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
             for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    out, stopped = run(stops, pieces)
    assert ("".join(out), stopped) == reference(stops, pieces)
    # Nothing emitted early: each output ends where no stop string can still begin.
    emitted = ""
    for piece in out[:-1] if not stopped else out:
        emitted += piece
        assert all(s not in emitted for s in stops)


def test_a_long_partial_match_that_breaks_costs_linear_time():
    """A stop string the output keeps matching, then breaks: held back, then released, in
    time linear in the text (the old matcher tried every prefix length, each a copy:
    quadratic, over a second here at 200k characters, with every stream on the loop waiting).
    At 1M characters: ~0.15 s linear, ~25 s quadratic; the bound between is generous."""
    import time

    length = 1_000_000
    m = StopStringMatcher(["x" * (length - 1) + "z"])
    out = [m.push("x" * 1000) for _ in range(length // 1000)]
    assert "".join(out) == "x" and len(m.held) == length - 1  # the rest may still stop
    start = time.perf_counter()
    out.append(m.push("y"))
    assert time.perf_counter() - start < 5.0
    assert "".join(out) == "x" * length + "y" and m.held == "" and not m.is_stopped
