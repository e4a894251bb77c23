"""Incremental detokenization that never emits half a character.

Byte-level BPE splits one emoji or CJK character over several tokens, and a decode that
ends mid-character shows U+FFFD. Two ways to release only whole characters:

- Byte-level vocabularies (GPT-2 style, SmolLM2): every token is a byte string, so feed
  the bytes to an incremental UTF-8 decoder, which keeps an incomplete trailing sequence
  until it completes. Exact and cheap (a table lookup per token).
- Others (sentencepiece-style): decode a small window of recent tokens and release only
  text that does not end in U+FFFD (the vLLM/TGI offsets scheme):
      prefix_offset .. read_offset   tokens already released (context for spacing)
      read_offset .. end             tokens whose text is not released yet

Invariant: everything `push` and `flush` return, concatenated, equals the decode of all
output tokens.
"""

from __future__ import annotations

import codecs

from gateway.tokenizer import TextTokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as context, so a sentencepiece tokenizer puts the right leading space
# on the first output word.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextTokenizer, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = None
        if tokenizer.is_byte_level:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._bytes = tokenizer.bytes_table()
            return
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the new text that is complete (possibly "")."""
        if not token_ids:
            return ""
        if self._utf8 is not None:
            return self._utf8.decode(b"".join(self._token_bytes(t) for t in token_ids))
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        full_text = self._decode(self.prefix_offset, len(self.ids))
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """At the end: release whatever is held, even an incomplete character."""
        if self._utf8 is not None:
            return self._utf8.decode(b"", final=True)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        full_text = self._decode(self.prefix_offset, len(self.ids))
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text):]

    def _token_bytes(self, token_id: int) -> bytes:
        if self.skip_special_tokens and self.tokenizer.is_special(token_id):
            return b""
        if 0 <= token_id < len(self._bytes):
            return self._bytes[token_id]
        return b""  # out of the vocabulary: nothing to show

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end],
                                     skip_special_tokens=self.skip_special_tokens)
