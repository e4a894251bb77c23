"""Reasoning output: the `<think>…</think>` text of reasoning models, split from the answer.

Two model families, as vLLM names their parsers (`--reasoning-parser`):

- **qwen3**: the model opens its thinking itself (`<think>` first in its output) unless the
  prompt already did; with `enable_thinking: false` the template writes an empty, closed
  `<think></think>` into the prompt and the output is all answer.
- **deepseek_r1**: the template opens `<think>` in the prompt (R1 and its distills), so the
  output starts inside the thinking; everything before `</think>` is reasoning, and an output
  that never closes it is all reasoning (cut by max_tokens while thinking).

Either way the prompt decides where the output starts: a prompt whose last `<think>` is still
open starts the output inside it (Qwen3-2507 "thinking" templates do that too).

Streaming-safe: text arrives in pieces and a tag may be split across them ("</th" + "ink>"),
so a tail that may be the start of the awaited tag is held back until the next piece says
(the detokenizer already never splits a UTF-8 character; the tags are ASCII).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


class _Phase(enum.Enum):
    START = 1  # nothing but whitespace yet: the output may still open <think>
    REASONING = 2
    ANSWER_START = 3  # just after the close tag: the newlines before the answer are dropped
    CONTENT = 4


@dataclass(frozen=True)
class ReasoningSyntax:
    """One model family's reasoning markers and where its output starts."""

    family: str  # one of REASONING_PARSERS
    open_tag: str = THINK_OPEN
    close_tag: str = THINK_CLOSE

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        """Whether the output starts inside the thinking, given the rendered prompt."""
        last_open = prompt_text.rfind(self.open_tag)
        if last_open >= 0:
            return prompt_text.find(self.close_tag, last_open) < 0
        return self.family == "deepseek_r1"

    def parser(self, prompt_text: str) -> ReasoningParser:
        return ReasoningParser(self, self.starts_in_reasoning(prompt_text))


def reasoning_syntax(name: str | None, template_source: str) -> ReasoningSyntax | None:
    """The parser named by `--reasoning-parser`, else one picked from the chat template (a
    template that writes `<think>` belongs to a reasoning model: qwen3's rules, which leave
    an output without tags untouched); None: the model does not reason."""
    if name is not None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}")
        return ReasoningSyntax(name)
    if re.search(re.escape(THINK_OPEN), template_source or ""):
        return ReasoningSyntax("qwen3")
    return None


class ReasoningParser:
    """One choice's text pieces -> (reasoning, content) pieces."""

    def __init__(self, syntax: ReasoningSyntax, starts_in_reasoning: bool = False):
        self.syntax = syntax
        self._phase = _Phase.REASONING if starts_in_reasoning else _Phase.START
        # The output may repeat the prompt's open tag ("<think>\n" first): drop it once.
        self._may_reopen = starts_in_reasoning
        self._held = ""

    @property
    def is_reasoning(self) -> bool:
        """Inside the thinking now (text that arrives next is reasoning, unless it closes)."""
        return self._phase is _Phase.REASONING

    def push(self, text: str) -> tuple[str, str]:
        """Add a piece of output; return what is safe to emit as (reasoning, content)."""
        return self._scan(self._held + text, final=False)

    def flush(self) -> tuple[str, str]:
        """The output ended: release what was held back."""
        return self._scan(self._held, final=True)

    def _scan(self, buffer: str, final: bool) -> tuple[str, str]:
        self._held = ""
        reasoning, content = [], []
        while buffer:
            if self._phase is _Phase.CONTENT:
                content.append(buffer)
                break
            if self._phase is _Phase.ANSWER_START:
                # The answer follows the tag after a blank line, which is not part of it.
                buffer = buffer.lstrip("\n")
                if buffer:
                    self._phase = _Phase.CONTENT
                continue
            if self._phase is _Phase.START:
                stripped = buffer.lstrip()
                if stripped.startswith(self.syntax.open_tag):
                    buffer = stripped[len(self.syntax.open_tag):]
                    self._phase = _Phase.REASONING
                    continue
                if not final and self.syntax.open_tag.startswith(stripped):
                    self._held = buffer  # whitespace, or the open tag still arriving
                    break
                self._phase = _Phase.CONTENT
                continue
            # REASONING
            if self._may_reopen:
                stripped = buffer.lstrip()
                if stripped.startswith(self.syntax.open_tag):
                    buffer = stripped[len(self.syntax.open_tag):]
                    self._may_reopen = False
                    continue
                if not final and self.syntax.open_tag.startswith(stripped):
                    self._held = buffer
                    break
                self._may_reopen = False
            before, found, after = buffer.partition(self.syntax.close_tag)
            if found:
                reasoning.append(before)
                buffer = after
                self._phase = _Phase.ANSWER_START
                continue
            keep = 0 if final else _partial_suffix(buffer, self.syntax.close_tag)
            reasoning.append(buffer[:len(buffer) - keep])
            self._held = buffer[len(buffer) - keep:]
            break
        return "".join(reasoning), "".join(content)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_reasoning(syntax: ReasoningSyntax, prompt_text: str, text: str) -> tuple[str, str]:
    """A whole output -> (reasoning, content)."""
    parser = syntax.parser(prompt_text)
    r1, c1 = parser.push(text)
    r2, c2 = parser.flush()
    return r1 + r2, c1 + c2
