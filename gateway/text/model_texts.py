"""The tokenizer and chat template of every model a gateway serves, keyed by served name.

A gateway that serves several models (`--add-model NAME=PATH`) tokenizes and renders each
request with its own model's tokenizer and template; every version of a served model shares
the first's (versions of one served name must share a vocabulary: a stream moves between
its workers only within a version, but an alias spreads one conversation's turns over
them). Loaded once, at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroserve.gateway.text.chat_template import ChatTemplate
from zeroserve.gateway.text.tokenizer import TextTokenizer, load_tokenizer


@dataclass(frozen=True)
class ModelText:
    name: str  # the served name
    path: str  # the model it was loaded from ("default", a .gguf file, an HF directory)
    tokenizer: TextTokenizer
    template: ChatTemplate


def load_model_text(name: str, path: str, tokenizer: TextTokenizer | None = None,
                    chat_template: str | None = None) -> ModelText:
    """`tokenizer`: one already loaded (tests); `chat_template`: a file replacing the
    model's own template."""
    tokenizer = tokenizer or load_tokenizer(path)
    if tokenizer.is_byte_level:
        tokenizer.shown_bytes_table()  # built now (with bytes_table), not on a request
    return ModelText(name, path, tokenizer,
                     ChatTemplate.from_tokenizer(tokenizer, chat_template))
