"""A GGUF with a SentencePiece vocabulary (tokenizer.ggml.model "llama": Llama 2, Mistral)
tokenizes as the SentencePiece model it was converted from: a tiny BPE model trained here
with Llama's settings (no normalization, digits split, byte fallback), written to GGUF the way
llama.cpp's converter writes one, then held to sentencepiece itself and to transformers."""

from __future__ import annotations

import io

import gguf
import pytest

from zeroserve.gateway.text.detokenizer import IncrementalDetokenizer
from zeroserve.gateway.text.tokenizer import load_tokenizer

CORPUS = """The quick brown fox jumps over the lazy dog. Hello, world! Hello there.
Once upon a time, in a small village by the sea, there lived an old fisherman.
def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)
The year 2024 had 366 days; 1,000,000 is a million. café naïve résumé
""" * 20

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces, and  double  spaces",
    "Numbers 12345 and 3.14159",
    "Unseen: 日本語 😀 Ελληνικά",  # byte fallback
    "line one\nline two\n\ttabbed",
    "",
    " ",
    "fisherman village seaside",
]
# llama.cpp's token types
NORMAL, UNKNOWN, CONTROL, UNUSED, BYTE = 1, 2, 3, 5, 6


@pytest.fixture(scope="module")
def spm():
    sentencepiece = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()), model_writer=model, model_type="bpe",
        vocab_size=400, byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, allow_whitespace_only_pieces=True,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, minloglevel=2)
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())


@pytest.fixture(scope="module")
def gguf_path(spm, tmp_path_factory):
    """Written as convert_hf_to_gguf.py's _create_vocab_sentencepiece does."""
    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    tokens, scores, types = [], [], []
    for i in range(spm.get_piece_size()):
        tokens.append(spm.id_to_piece(i))
        scores.append(spm.get_score(i))
        types.append(UNKNOWN if spm.is_unknown(i) else CONTROL if spm.is_control(i)
                     else UNUSED if spm.is_unused(i) else BYTE if spm.is_byte(i) else NORMAL)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(4096)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    writer.add_chat_template("{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_tokenizer(str(gguf_path))


@pytest.mark.parametrize("text", TEXTS)
def test_same_ids_as_sentencepiece(ours, spm, text):
    assert ours.encode(text, add_special_tokens=False) == spm.encode(text)
    assert ours.encode(text) == [1, *spm.encode(text)]  # add_bos_token
    assert ours.decode(spm.encode(text)) == spm.decode(spm.encode(text))


def test_same_ids_as_transformers_from_the_same_file(ours, gguf_path):
    """transformers' GGUF loader agrees, except on text that starts with a space, where it
    leaves out the prefix space that SentencePiece and llama.cpp add."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for text in TEXTS:
        if not text.startswith(" "):
            assert ours.encode(text) == reference(text)["input_ids"], text


def test_special_tokens_in_text_are_one_token_each(ours, spm):
    """As llama.cpp parses them: the token, then the text after it with its prefix space
    (sentencepiece itself would spell "</s>" out as text)."""
    ids = ours.encode("</s> is text, <s>too", add_special_tokens=False)
    assert ids == [2, *spm.encode(" is text, "), 1, *spm.encode("too")]


def test_special_tokens_and_metadata(ours):
    assert (ours.bos_token, ours.eos_token, ours.eos_token_ids) == ("<s>", "</s>", (2,))
    assert not ours.is_byte_level and ours.max_model_len == 4096
    assert ours.chat_template.startswith("{% for m in messages %}")
    assert ours.is_special(1) and ours.is_special(2)
    assert ours.decode([1, *ours.encode("Hello", add_special_tokens=False), 2]) == "Hello"


def test_incremental_detokenization_rebuilds_the_text(ours):
    """Streamed pieces add up to the text, spaces and byte-fallback characters included."""
    prompt = ours.encode("Once upon a time,")
    for text in ["there lived an old fisherman.", "Unseen: 日本語 😀 ok", "  spaced  out"]:
        ids = ours.encode(" " + text, add_special_tokens=False)
        detok = IncrementalDetokenizer(ours, prompt)
        streamed = "".join(detok.push([t]) for t in ids) + detok.flush()
        assert streamed == ours.decode(prompt + ids)[len(ours.decode(prompt)):]


def test_token_bytes_keep_the_spaces_a_piece_stands_for(ours, spm):
    """For logprobs: a piece's own bytes, its space included; a byte-fallback piece is its
    byte (half a character shows as bytes:)."""
    the = spm.piece_to_id("\u2581the")
    assert the != spm.unk_id() and ours.token_bytes(the) == b" the"
    assert ours.token_text(the) == " the"
    first_byte = ours.encode("日", add_special_tokens=False)[-3]
    assert ours.token_bytes(first_byte) == "日".encode()[:1]
    assert ours.token_text(first_byte) == "bytes:\\xe6"
