"""The reasoning parser: <think> text split from the answer, whole and in pieces split at
every position (a tag split across tokens must never leak into either side)."""

from __future__ import annotations

import pytest

from zeroserve.gateway.text.reasoning import (
    ReasoningSyntax,
    reasoning_syntax,
    split_reasoning,
)

QWEN3 = ReasoningSyntax("qwen3")
R1 = ReasoningSyntax("deepseek_r1")
CHATML_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
OPEN_PROMPT = CHATML_PROMPT + "<think>\n"
CLOSED_PROMPT = CHATML_PROMPT + "<think>\n\n</think>\n\n"

CASES = [
    # (syntax, prompt, output, reasoning, content)
    (QWEN3, CHATML_PROMPT, "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n",
     "It is 4."),
    (QWEN3, CHATML_PROMPT, "It is 4, no thinking.", "", "It is 4, no thinking."),
    (QWEN3, CHATML_PROMPT, "\n<think>a<b</think>c", "a<b", "c"),
    (QWEN3, CHATML_PROMPT, "<think>cut by max_tokens", "cut by max_tokens", ""),
    (QWEN3, CLOSED_PROMPT, "Answer <think> in text", "", "Answer <think> in text"),
    (QWEN3, OPEN_PROMPT, "thinking</think>\n\nanswer", "thinking", "answer"),
    (QWEN3, CHATML_PROMPT, "", "", ""),
    (R1, CHATML_PROMPT, "thinking</think>answer", "thinking", "answer"),
    (R1, CHATML_PROMPT, "<think>\nthinking</think>\n\nanswer", "\nthinking", "answer"),
    (R1, CHATML_PROMPT, "never closed </thin", "never closed </thin", ""),
    (R1, CLOSED_PROMPT, "plain answer", "", "plain answer"),
    (R1, OPEN_PROMPT, "x</think></think>y", "x", "</think>y"),
]


@pytest.mark.parametrize(("syntax", "prompt", "output", "reasoning", "content"), CASES)
def test_whole_output(syntax, prompt, output, reasoning, content):
    assert split_reasoning(syntax, prompt, output) == (reasoning, content)


@pytest.mark.parametrize(("syntax", "prompt", "output", "reasoning", "content"), CASES)
def test_split_at_every_position(syntax, prompt, output, reasoning, content):
    """Two pieces split at each position, and one character a piece: the same result, and
    nothing of a tag in either side's pieces."""
    splits = [[output[:i], output[i:]] for i in range(len(output) + 1)]
    splits.append(list(output))
    for pieces in splits:
        parser = syntax.parser(prompt)
        got_r, got_c = [], []
        for piece in pieces:
            r, c = parser.push(piece)
            got_r.append(r)
            got_c.append(c)
        r, c = parser.flush()
        got_r.append(r)
        got_c.append(c)
        assert ("".join(got_r), "".join(got_c)) == (reasoning, content), pieces


def test_three_way_splits_of_a_tagged_output():
    output = "<think>ab</think>\n\ncd"
    for i in range(len(output) + 1):
        for j in range(i, len(output) + 1):
            parser = QWEN3.parser(CHATML_PROMPT)
            parts = [parser.push(output[:i]), parser.push(output[i:j]),
                     parser.push(output[j:]), parser.flush()]
            assert "".join(p[0] for p in parts) == "ab"
            assert "".join(p[1] for p in parts) == "cd"
            assert not any("<" in p[0] or "<" in p[1] for p in parts)


def test_is_reasoning_follows_the_output():
    parser = QWEN3.parser(CHATML_PROMPT)
    assert not parser.is_reasoning
    parser.push("<think>x")
    assert parser.is_reasoning
    parser.push("</think>y")
    assert not parser.is_reasoning


def test_picked_from_the_flag_or_the_template():
    assert reasoning_syntax("deepseek_r1", "").family == "deepseek_r1"
    assert reasoning_syntax(None, "{{ '<think>\\n' }}").family == "qwen3"
    assert reasoning_syntax(None, "{{ messages }}") is None
    with pytest.raises(ValueError):
        reasoning_syntax("gpt", "")
