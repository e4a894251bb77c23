"""The model's tokenizer, built with the `tokenizers` library from the model's own metadata.

- GGUF: llama.cpp stores the vocabulary as `tokenizer.ggml.*` keys; we rebuild the tokenizer
  from them. Two kinds: byte-level BPE ("gpt2": Llama 3, Qwen, SmolLM) and SentencePiece
  ("llama": Llama 2, Mistral), whose pieces spell spaces as U+2581, fall back to `<0xNN>`
  byte tokens, and merge by score: as BPE, a merge of two pieces ranks by the score of the
  piece it makes (what llama.cpp's SPM tokenizer and transformers' GGUF loader both do). `tokenizer.ggml.pre` names the pre-tokenizer the
  merges were learned with: for "smollm" (and the StarCoder family) llama.cpp first
  isolates every digit (`\\p{N}`) and then applies GPT-2's split regex, which is what the
  model's own tokenizer.json says (Digits(individual_digits) then ByteLevel).
- Hugging Face directory: tokenizer.json, with tokenizer_config.json for the special
  tokens and chat template.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from zeroserve.common.gguf_metadata import read_gguf_metadata
from zeroserve.common.model_files import resolve_model

# llama.cpp token types (tokenizer.ggml.token_type)
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4
_SPIECE_SPACE = "\u2581"

# Pre-tokenizer families by `tokenizer.ggml.pre`, following llama.cpp's llama-vocab.cpp.
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_REPLACEMENT_BYTES = "\ufffd".encode()


class TokenizerLoadError(ValueError):
    pass


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE spelling)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


@dataclass
class TextTokenizer:
    """What the gateway needs from a tokenizer: encode, decode, special tokens, template."""

    tokenizer: Tokenizer
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    max_model_len: int | None  # the model's trained context, when the files say
    is_byte_level: bool

    def __post_init__(self) -> None:
        added = self.tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self._added_ids = frozenset(added)
        self._bytes_table: list[bytes] | None = None
        self._shown_bytes_table: list[bytes] | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    # The *_batch calls release the GIL while they work (plain encode/decode hold it: a 1M-
    # character encode in a thread still stalled the event loop for 1.1 s), and cost the
    # same for one text. So a long text tokenized in a thread leaves the loop free.
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (for logprobs' `bytes`, byte-level detok)."""
        table = self.bytes_table()
        if 0 <= token_id < len(table):
            return table[token_id]
        return self._piece_bytes(token_id)

    def exact_bytes(self, token_id: int) -> bytes | None:
        """As token_bytes, without building the whole table (for a few tokens), and None
        where the bytes are unknown: a piece that decodes to U+FFFD on its own while its
        spelling holds none is part of a character split over tokens."""
        raw = self.token_bytes(token_id) if self._bytes_table is not None else \
            self._piece_bytes(token_id)
        if _REPLACEMENT_BYTES in raw and "\ufffd" not in (self.tokenizer.id_to_token(token_id)
                                                         or ""):
            return None
        return raw

    def bytes_table(self) -> list[bytes]:
        """token id -> bytes, built once (byte-level vocabularies make this exact)."""
        if self._bytes_table is None:
            self._bytes_table = [self._piece_bytes(i) for i in range(self.vocab_size)]
        return self._bytes_table

    def shown_bytes_table(self) -> list[bytes]:
        """As bytes_table, with the special tokens' bytes empty (they are not shown when
        special tokens are skipped): one list lookup per token for the detokenizer."""
        if self._shown_bytes_table is None:
            table = list(self.bytes_table())
            for i in self._special_ids:
                if 0 <= i < len(table):
                    table[i] = b""
            self._shown_bytes_table = table
        return self._shown_bytes_table

    def _piece_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self.is_byte_level and token_id not in self._added_ids:
            table = unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if _BYTE_FALLBACK.fullmatch(piece):  # sentencepiece's <0xE6>: one raw byte
            return bytes([int(piece[3:5], 16)])
        if _SPIECE_SPACE in piece and token_id not in self._added_ids:
            # "▁the" is " the": decoding it alone would strip the prefix space.
            return piece.replace(_SPIECE_SPACE, " ").encode()
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def token_text(self, token_id: int) -> str:
        """One token as text; an incomplete UTF-8 piece shows its bytes as `bytes:\\xNN`."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def load_tokenizer(model: str) -> TextTokenizer:
    """From "default", a .gguf file or a Hugging Face directory."""
    path = resolve_model(model)
    if path.is_dir():
        return _from_hf_dir(path)
    if path.suffix == ".gguf":
        return _from_gguf(path)
    raise TokenizerLoadError(f"cannot find a tokenizer for {model}")


# --- GGUF -----------------------------------------------------------------------------------

def _from_gguf(path: Path) -> TextTokenizer:
    meta = read_gguf_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tk = _gguf_byte_level_bpe(meta)
    elif kind == "llama":
        tk = _gguf_sentencepiece(meta)
    else:
        raise TokenizerLoadError(
            f"{path.name}: tokenizer.ggml.model={kind!r} is not supported (byte-level BPE"
            " 'gpt2' and SentencePiece 'llama' are); use the model's Hugging Face directory")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]

    def special(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

    bos, eos = special("bos_token_id"), special("eos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))])
    eos_ids = [meta["tokenizer.ggml.eos_token_id"]] if eos is not None else []
    for key in ("eot_token_id", "eom_token_id"):  # end of turn / of message: stop there too
        extra = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(extra, int) and extra not in eos_ids:
            eos_ids.append(extra)
    arch = meta.get("general.architecture")
    ctx = meta.get(f"{arch}.context_length")
    return TextTokenizer(tk, bos, eos, tuple(eos_ids), meta.get("tokenizer.chat_template"),
                         int(ctx) if ctx else None, is_byte_level=kind == "gpt2")


def _gguf_byte_level_bpe(meta: dict) -> Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    alphabet = set(byte_to_unicode().values())
    spell = byte_to_unicode()
    vocab = {}
    for i, tok in enumerate(tokens):
        # A token written outside the byte alphabet (rare) is respelled from its UTF-8 bytes.
        if not set(tok) <= alphabet:
            tok = "".join(spell[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    tk = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True)
                           for t, ty in zip(tokens, token_types, strict=False)
                           if ty == _TOKEN_CONTROL and set(t) <= alphabet])
    _add_user_defined(tk, tokens, token_types)
    return tk


def _add_user_defined(tk: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    tk.add_tokens([AddedToken(t, normalized=False, special=False)
                   for t, ty in zip(tokens, token_types, strict=False)
                   if ty == _TOKEN_USER_DEFINED])


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's merge-by-score: every split of a piece
    into two pieces of the vocabulary, best score of the merged piece first (then the
    longer left part, then the longer right part, then vocabulary order)."""
    index = {}
    for i, tok in enumerate(tokens):
        index.setdefault(tok, i)
    ranked = []
    for i, tok in enumerate(tokens):
        if index[tok] != i:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in index and right in index:
                ranked.append((-scores[i], -len(left), -len(right), i, index[left], left, right))
    ranked.sort(key=lambda r: r[:5])
    return [(r[5], r[6]) for r in ranked]


def _gguf_sentencepiece(meta: dict) -> Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    scores: list[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    tk = Tokenizer(models.BPE(vocab, sentencepiece_merges(tokens, scores), unk_token=unk,
                              fuse_unk=True, byte_fallback=True))
    # SentencePiece (and llama.cpp, after every special token) put one space before the
    # text even where it starts with spaces; a normalizer does that per segment between
    # special tokens. (Metaspace would skip it on text that starts with a space.)
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", _SPIECE_SPACE)
    tk.normalizer = normalizers.Sequence([normalizers.Prepend(_SPIECE_SPACE), spaces]) \
        if prefix_space else spaces
    steps = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tk.decoder = decoders.Sequence(steps)
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True)
                           for t, ty in zip(tokens, token_types, strict=False)
                           if ty == _TOKEN_CONTROL])
    _add_user_defined(tk, tokens, token_types)
    return tk


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level_gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level_gpt2])
    if pre in _REGEX_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return byte_level_gpt2  # "gpt2", "default" and anything unknown: GPT-2's regex


# --- Hugging Face directory ---------------------------------------------------------------

def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _from_hf_dir(path: Path) -> TextTokenizer:
    file = path / "tokenizer.json"
    if not file.is_file():
        raise TokenizerLoadError(f"{path} has no tokenizer.json")
    tk = Tokenizer.from_file(str(file))
    cfg = _read_json(path / "tokenizer_config.json")
    model_cfg = _read_json(path / "config.json")
    gen_cfg = _read_json(path / "generation_config.json")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    bos, eos = _token_content(cfg.get("bos_token")), _token_content(cfg.get("eos_token"))
    eos_ids: list[int] = []
    for source in (gen_cfg.get("eos_token_id"), model_cfg.get("eos_token_id")):
        for i in source if isinstance(source, list) else [source]:
            if isinstance(i, int) and i not in eos_ids:
                eos_ids.append(i)
    if eos is not None and tk.token_to_id(eos) is not None and tk.token_to_id(eos) not in eos_ids:
        eos_ids.append(tk.token_to_id(eos))
    ctx = model_cfg.get("max_position_embeddings")
    is_byte_level = "ByteLevel" in json.dumps(json.loads(tk.to_str()).get("decoder"))
    return TextTokenizer(tk, bos, eos, tuple(eos_ids), template,
                         int(ctx) if isinstance(ctx, int) else None, is_byte_level)
