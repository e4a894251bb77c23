"""Constrained decoding: a grammar (a JSON schema, a Lark grammar or a regex) per request, as a
token mask per step, with llguidance (a Rust engine on the CPU; no torch of its own).

- `GrammarSpec` is what a request asks for (kind + source text), as it travels in SUBMIT.
- `GrammarCompiler` owns the model's vocabulary as llguidance sees it (built once, lazily, from
  the model files: a GGUF file's `tokenizer.ggml.*` keys or a Hugging Face tokenizer.json) and
  a cache of compiled grammars keyed by (kind, source): a new request with a known grammar
  costs a deep copy of a ready matcher, not a compilation. A compilation (milliseconds to
  seconds) runs off the engine thread (worker/grammar_pending.py).
- `GrammarState` is one sequence's matcher and how many of its output tokens it consumed. It
  rides on the request's SamplingParams (one object per request), so it lives and dies with
  the sequence. Before each mask the sampler `sync`s it to the sequence's output tokens: a
  stream that moved from another worker (SUBMIT with output tokens) or was preempted and
  recomputed resumes its grammar by advancing over the tokens it already has.

This module imports llguidance and numpy only when a grammar is compiled, so the engine core
stays light; the sampler (torch) applies the masks.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeroserve.common.protocol import GRAMMAR_KINDS, MAX_GRAMMAR_CHARS

MAX_CACHED_GRAMMARS = 64  # compiled matchers kept (each may hold a large lexer)
# Compact JSON: a small model offered free whitespace may emit newlines until max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# Consumed tokens a sequence's matcher can give back (speculative drafts, at most 16, then
# rejected); more than that starts the matcher over from the outputs.
ROLLBACK_WINDOW = 32


class GrammarError(ValueError):
    """A grammar the engine refuses (invalid, too large, or no vocabulary to apply it to)."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of GRAMMAR_KINDS
    source: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}")
        if not isinstance(self.source, str) or not 0 < len(self.source) <= MAX_GRAMMAR_CHARS:
            raise GrammarError(f"a grammar must have 1 to {MAX_GRAMMAR_CHARS} characters")

    @classmethod
    def from_wire(cls, value: Any) -> GrammarSpec:
        if not (isinstance(value, (list, tuple)) and len(value) == 2
                and all(isinstance(v, str) for v in value)):
            raise GrammarError("grammar must be [kind, source]")
        return cls(value[0], value[1])

    def to_wire(self) -> list[str]:
        return [self.kind, self.source]


@dataclass(eq=False)
class GrammarState:
    """One sequence's grammar: identity-hashed, mutable, owned by the request's params."""

    spec: GrammarSpec
    matcher: Any = None  # llguidance.LLMatcher, attached by GrammarCompiler.attach
    num_consumed: int = 0  # output tokens the matcher has consumed
    failed: str | None = field(default=None)  # the matcher's error, once it has one
    # The last consumed tokens (at most ROLLBACK_WINDOW): speculative rows consume drafts
    # that may then be rejected, and the next sync rolls back to where they part.
    recent: list[int] = field(default_factory=list)

    def sync(self, output_token_ids: list[int]) -> None:
        """Advance the matcher over the outputs it has not seen (normally the one token
        sampled last step; after a failover, every token the stream already had). Tokens it
        consumed that are not the outputs' (rejected speculative drafts) are rolled back
        first."""
        n = self.num_consumed
        recent = self.recent
        start = n - len(recent)
        if len(output_token_ids) < n or output_token_ids[start:n] != recent:
            same = start
            limit = min(n, len(output_token_ids))
            while same < limit and output_token_ids[same] == recent[same - start]:
                same += 1
            matcher = self.matcher
            if (same > start or start == 0) and self.failed is None \
                    and not matcher.is_stopped() and matcher.rollback(n - same):
                del recent[same - start:]
            else:  # beyond the window, or a stopped or failed matcher: start over
                matcher.reset()
                self.failed = None
                recent.clear()
                same = 0
            self.num_consumed = n = same
        new = output_token_ids[n:]
        for token in new:
            if self.matcher.is_stopped():
                break  # the grammar is complete: only EOS follows (and ends the sequence)
            if not self.matcher.consume_token(token):
                self.failed = self.matcher.get_error() or "token rejected by the grammar"
                break
        recent += new
        if len(recent) > ROLLBACK_WINDOW:
            del recent[:-ROLLBACK_WINDOW]
        self.num_consumed = len(output_token_ids)

    def num_allowed(self, output_token_ids: list[int], tokens: list[int]) -> int:
        """How many of `tokens`, following the outputs, the grammar allows in a row (the
        matcher is synced to the outputs; the tokens are not consumed)."""
        self.sync(output_token_ids)
        if self.is_done:
            return 0
        return self.matcher.validate_tokens(tokens)

    @property
    def is_done(self) -> bool:
        """The grammar accepts no more tokens: the sequence should end now."""
        return self.failed is not None or self.matcher.is_stopped()


class GrammarCompiler:
    """The vocabulary for llguidance and a cache of compiled grammars, for one model."""

    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.model_path = Path(model_path)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()
        # Compilation runs on a thread of its own (worker/grammar_pending.py) while the engine
        # thread looks grammars up: the cache is touched only under this lock.
        self._cache_lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()  # spec -> fresh LLMatcher

    @property
    def tokenizer(self):
        """llguidance.LLTokenizer for the model (built on first use: ~0.2 s)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = load_ll_tokenizer(self.model_path, self.vocab_size,
                                                    self.eos_token_ids)
            return self._tokenizer

    def attach(self, spec: GrammarSpec) -> GrammarState:
        """A fresh state for one sequence. Raises GrammarError for an invalid grammar."""
        return GrammarState(spec, self.compile(spec).deep_copy())

    def check_vocabulary(self) -> None:
        """Raise GrammarError at once where no grammar could ever apply (cheap: file checks;
        the vocabulary itself is built with the first compilation)."""
        if self.model_path.is_dir():
            if not (self.model_path / "tokenizer.json").is_file():
                raise GrammarError("the model directory has no tokenizer.json")
        elif self.model_path.suffix != ".gguf":
            raise GrammarError("constrained decoding needs the model's vocabulary (GGUF or "
                               "tokenizer.json)")

    def cached(self, spec: GrammarSpec) -> Any | None:
        """The compiled template for `spec` if it is cached (copy it per sequence), else None."""
        with self._cache_lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
            return template

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled template for `spec` (cached). Seconds for a large schema: call it off
        the engine thread. Raises GrammarError for an invalid grammar."""
        import llguidance

        template = self.cached(spec)
        if template is not None:
            return template
        grammar = _ll_grammar(spec)
        tokenizer = self.tokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, tokenizer)
        if is_error:
            raise GrammarError(f"invalid grammar: {messages[0] if messages else ''}")
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"invalid grammar: {template.get_error()}")
        with self._cache_lock:
            self._cache[spec] = template
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return template


def _ll_grammar(spec: GrammarSpec) -> str:
    import llguidance

    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.source)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    return llguidance.LLMatcher.grammar_from_regex(spec.source)


# --- the vocabulary ------------------------------------------------------------------

# llama.cpp token types (tokenizer.ggml.token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def load_ll_tokenizer(model_path: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """An llguidance tokenizer for the model's vocabulary, padded to the logits' width."""
    import llguidance

    eos = list(eos_token_ids)
    if model_path.is_dir():
        tokenizer_json = model_path / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise GrammarError("the model directory has no tokenizer.json")
        return llguidance.LLTokenizer(tokenizer_json.read_text(encoding="utf-8"),
                                      n_vocab=vocab_size, eos_token=eos)
    if model_path.suffix != ".gguf":
        raise GrammarError("constrained decoding needs the model's vocabulary (GGUF or "
                           "tokenizer.json)")
    vocab = GGUFVocabulary.read(model_path, eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=vocab_size,
                                  eos_token=eos)


class GGUFVocabulary:
    """A GGUF vocabulary in the shape llguidance.TokenizerWrapper reads: every token's bytes,
    the special ids, and an encoder (greedy longest match; llguidance only encodes short
    forced strings with it, the masks come from the token bytes)."""

    def __init__(self, tokens: list[bytes], special_token_ids: list[int],
                 eos_token_ids: list[int], bos_token_id: int | None):
        self.tokens = tokens
        self.special_token_ids = special_token_ids
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else 0
        self.bos_token_id = bos_token_id
        special = set(special_token_ids)
        self._lookup: dict[bytes, int] = {}
        for i, t in enumerate(tokens):
            if i not in special and t:
                self._lookup.setdefault(t, i)
        self._max_len = max((len(t) for t in self._lookup), default=1)

    @classmethod
    def read(cls, path: Path, eos_token_ids: list[int]) -> GGUFVocabulary:
        from zeroserve.common.gguf_metadata import read_gguf_metadata

        meta = read_gguf_metadata(path)
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise GrammarError("the GGUF file holds no vocabulary")
        types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        model = meta.get("tokenizer.ggml.model", "gpt2")
        if model == "gpt2":
            table = _unicode_to_byte()
            def spell(t: str) -> bytes:  # noqa: E306
                return bytes(table[c] for c in t) if all(c in table for c in t) else t.encode()
        elif model == "llama":
            def spell(t: str) -> bytes:  # noqa: E306
                return t.replace("\u2581", " ").encode()
        else:
            raise GrammarError(f"GGUF vocabularies of kind {model!r} are not supported")
        out, special = [], []
        for i, (t, kind) in enumerate(zip(tokens, types, strict=False)):
            if kind in (_CONTROL, _UNKNOWN, _UNUSED):
                special.append(i)
                out.append(t.encode())
            elif kind == _BYTE and len(t) == 6 and t.startswith("<0x"):
                out.append(bytes([int(t[3:5], 16)]))
            elif kind == _USER_DEFINED:
                out.append(t.encode())
            else:
                out.append(spell(t))
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(out, special, eos_token_ids, bos if isinstance(bos, int) else None)

    def __call__(self, text: bytes | str) -> list[int]:
        data = text.encode() if isinstance(text, str) else bytes(text)
        ids, i = [], 0
        while i < len(data):
            for n in range(min(self._max_len, len(data) - i), 0, -1):
                token = self._lookup.get(data[i:i + n])
                if token is not None:
                    ids.append(token)
                    i += n
                    break
            else:
                i += 1  # a byte no token spells: skip it (cannot happen with byte tokens)
        return ids


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level BPE spelling, reversed: printable character -> byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table
