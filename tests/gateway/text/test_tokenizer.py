"""The gateway's tokenizer, built from the GGUF's metadata, against transformers' tokenizer
loaded from the same file: same ids on varied text, and decode round trips."""

from __future__ import annotations

import pytest

from zeroserve.common.model_files import default_model_path
from zeroserve.gateway.text.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 12:45 and we'll've done.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 100; ++i) { x[i] = i * 3.14159; }  // C-style",
    "Numbers: 0 7 42 123 2024 31415926535 1,000,000.50 -17 3e10 x2 v1.2.3",
    "Emoji: 😀 👍🏽 🇫🇷 👨‍👩‍👧‍👦 ❤️ done",
    "CJK: 日本語のテキスト、中文文本，한국어 텍스트。",
    "Whitespace:   three spaces\t\ttabs\n\n\nnewlines   \n  trailing   ",
    "   leading spaces and a lone \r\n CRLF",
    "Mixed ÄÖÜ äöü ß ñ café naïve résumé Ελληνικά Русский عربى",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "URLs https://example.com/a?b=c&d=e#f and emails a.b@c.de",
    "",
    " ",
    "'s 't 're 've 'm 'll 'd 'S 'T",
    "a" * 300 + " " + "ab" * 100,
]


@pytest.fixture(scope="module")
def ours():
    return load_tokenizer("default")


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_same_ids_as_transformers(ours, reference, text):
    assert ours.encode(text, add_special_tokens=False) == reference.encode(
        text, add_special_tokens=False)
    assert ours.encode(text) == reference.encode(text)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(ours, reference, text):
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids)


@pytest.mark.slow
def test_special_tokens_and_metadata(ours, reference):
    assert ours.bos_token == reference.bos_token
    assert ours.eos_token == reference.eos_token
    assert ours.eos_token_ids == (reference.eos_token_id,)
    assert ours.vocab_size == len(reference)
    assert ours.max_model_len == 8192
    assert ours.chat_template and "<|im_start|>" in ours.chat_template
    # Special tokens stay whole and are dropped when decoding output.
    ids = ours.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids) == "hi"


@pytest.mark.slow
def test_digits_are_split_one_by_one(ours):
    # SmolLM2's tokenizer isolates every digit (llama.cpp "smollm" pre-tokenizer).
    ids = ours.encode("12345", add_special_tokens=False)
    assert [ours.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]


@pytest.mark.slow
def test_non_ascii_numerals_follow_the_models_own_pre_tokenizer(ours, reference):
    """transformers' GGUF loader ignores `tokenizer.ggml.pre = smollm` and splits with the
    plain GPT-2 regex, so " ⅷ" (a numeral) can merge with its space there. SmolLM2's own
    tokenizer.json and llama.cpp isolate every numeral first; we follow the model's own
    tokenizer. Check against transformers with that pre-tokenizer put back."""
    from tokenizers import pre_tokenizers

    text = "Roman ⅷ, Arabic-Indic ٣٤, superscript x² and 10½"
    reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    try:
        assert ours.encode(text, add_special_tokens=False) == reference.encode(
            text, add_special_tokens=False)
    finally:
        reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(
            add_prefix_space=False, trim_offsets=True, use_regex=True)


@pytest.mark.slow
def test_token_bytes_rebuild_text(ours):
    text = "héllo 😀 日本語"
    ids = ours.encode(text, add_special_tokens=False)
    assert b"".join(ours.token_bytes(i) for i in ids).decode() == text


@pytest.mark.slow
def test_gguf_metadata_reader_matches_the_gguf_package():
    gguf = pytest.importorskip("gguf")
    from zeroserve.common.gguf_metadata import read_gguf_metadata

    path = default_model_path()
    ours = read_gguf_metadata(path)
    fields = {k: f for k, f in gguf.GGUFReader(str(path)).fields.items()
              if not k.startswith("GGUF.")}
    assert set(ours) == set(fields)
    for key, field in fields.items():
        assert ours[key] == field.contents(), key


@pytest.mark.slow
def test_hugging_face_directory(tmp_path, ours):
    """A HF model dir (tokenizer.json + tokenizer_config.json) loads the same tokenizer,
    template and special tokens as transformers reads from it."""
    import json

    transformers = pytest.importorskip("transformers")
    ours.tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "chat_template": ours.chat_template, "model_max_length": 8192}))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "max_position_embeddings": 4096, "eos_token_id": 2}))
    from zeroserve.gateway.text.chat_template import ChatTemplate

    hf = load_tokenizer(str(tmp_path))
    assert hf.eos_token_ids == (2,) and hf.max_model_len == 4096 and hf.is_byte_level
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert hf.encode(text) == reference.encode(text)
    messages = [{"role": "user", "content": "Hi 😀"}]
    assert ChatTemplate.from_tokenizer(hf).render(messages) == \
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
