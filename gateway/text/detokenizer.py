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
output tokens, except that a reply cut (by max_tokens, a stop token) in the middle of a
character ends before it: the bytes of an incomplete last character are dropped, never
shown as U+FFFD. Streamed and non-streamed replies are built from the same pieces, so they
are equal.
"""

from __future__ import annotations

import codecs

from zeroserve.gateway.text.tokenizer import TextTokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as context, so a sentencepiece tokenizer puts the right leading space
# on the first output word.
_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, so the bytes of an incomplete one come from at most
# the last 4 tokens that have bytes; a few more absorb special tokens after it.
_TAIL_TOKENS = 8


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextTokenizer, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = None
        if tokenizer.is_byte_level:
            self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._utf8 = self._decoder.decode
            self._bytes = tokenizer.shown_bytes_table() if skip_special_tokens \
                else tokenizer.bytes_table()
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
            table = self._bytes
            if len(token_ids) == 1:  # the usual case: one token per stream per step
                token_id = token_ids[0]
                data = table[token_id] if 0 <= token_id < len(table) else b""
            else:
                data = b"".join(self._token_bytes(t) for t in token_ids)
            if not self._decoder.buffer:
                # Nothing held: bytes that are whole UTF-8 are their text, decoded in C. The
                # codec's incremental decode is Python around the same C call; it takes the
                # rest (a character split across tokens, invalid bytes).
                try:
                    return data.decode()
                except UnicodeDecodeError:
                    pass
            return self._utf8(data)
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        full_text = self._decode(self.prefix_offset, len(self.ids))
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """At the end: release whatever is held, except the bytes of an incomplete last
        character."""
        if self._utf8 is not None:
            self._decoder.reset()  # what it still holds is an incomplete character's bytes
            return ""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        full_text = self._decode(self.prefix_offset, len(self.ids))
        num_incomplete = self._num_incomplete_tail_bytes()
        self.prefix_offset = self.read_offset = len(self.ids)
        text = full_text[len(prefix_text):]
        # The decoder showed those bytes as U+FFFD: one per byte (sentencepiece's byte
        # fallback) or one for the lot (lossy UTF-8). Drop those, no more.
        while num_incomplete > 0 and text.endswith(_REPLACEMENT):
            text = text[:-1]
            num_incomplete -= 1
        return text

    def _num_incomplete_tail_bytes(self) -> int:
        """How many bytes at the end of the unreleased tokens start a character that never
        completed (0 if the text ends whole). Where a tail token's bytes are unknown (a
        fragment only the decoder knows), every trailing U+FFFD counts as incomplete."""
        tail = self.ids[max(self.read_offset, len(self.ids) - _TAIL_TOKENS):]
        pieces = [self._token_bytes(t) for t in tail]
        if any(p is None for p in pieces):
            return len(tail)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        decoder.decode(b"".join(pieces))
        return len(decoder.getstate()[0])

    def _token_bytes(self, token_id: int) -> bytes | None:
        if self.skip_special_tokens and self.tokenizer.is_special(token_id):
            return b""
        if self._utf8 is None:
            return self.tokenizer.exact_bytes(token_id)
        if 0 <= token_id < len(self._bytes):
            return self._bytes[token_id]
        return b""  # out of the vocabulary: nothing to show

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end],
                                     skip_special_tokens=self.skip_special_tokens)
