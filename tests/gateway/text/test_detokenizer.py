"""Incremental detokenization: no U+FFFD from split characters, deltas add up to the text."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tests.gateway.helpers import byte_tokenizer
from zeroserve.gateway.text.detokenizer import IncrementalDetokenizer
from zeroserve.gateway.text.tokenizer import load_tokenizer

TEXTS = [
    "Plain English, nothing special.",
    "Emoji 😀👍🏽🇫🇷👨‍👩‍👧‍👦 between words ❤️!",
    "日本語のテキスト、中文文本，한국어 텍스트。",
    "mixed: café 😀 日本 x² → ∑ done",
    "code:\n\tif (a && b) { return 0; }\n",
]


def stream(detok: IncrementalDetokenizer, ids: list[int], batch_sizes) -> list[str]:
    deltas, i = [], 0
    for size in batch_sizes:
        if i >= len(ids):
            break
        deltas.append(detok.push(ids[i:i + size]))
        i += size
    if i < len(ids):
        deltas.append(detok.push(ids[i:]))
    deltas.append(detok.flush())
    return deltas


@pytest.fixture(scope="module")
def smollm():
    return load_tokenizer("default")


def window_path_tokenizer():
    """The same vocabulary, treated as non-byte-level: exercises the decode-window path."""
    tk = byte_tokenizer()
    return dataclasses.replace(tk, is_byte_level=False)


@pytest.mark.parametrize("make", [byte_tokenizer, window_path_tokenizer])
@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokens_one_at_a_time(text, make):
    tk = make()
    ids = tk.encode(text)
    assert len(ids) == len(text.encode())  # every byte its own token
    deltas = stream(IncrementalDetokenizer(tk), ids, [1] * len(ids))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    # Whole characters only: every delta is valid text on its own.
    assert all(d.encode().decode() == d for d in deltas)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm_tokens_in_random_batches(smollm, text):
    ids = smollm.encode(text, add_special_tokens=False)
    rng = random.Random(len(text))
    for _ in range(5):
        sizes = [rng.randint(1, 3) for _ in ids]
        deltas = stream(IncrementalDetokenizer(smollm, [1, 2, 3]), ids, sizes)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == smollm.decode(ids) == text


@pytest.mark.slow
def test_emoji_split_across_tokens_is_held_back(smollm):
    ids = smollm.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits it
    detok = IncrementalDetokenizer(smollm)
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


@pytest.mark.parametrize("make", [byte_tokenizer, window_path_tokenizer])
def test_special_tokens_are_skipped(make):
    tk = make()
    detok = IncrementalDetokenizer(tk)
    out = detok.push([104, 105]) + detok.push([257]) + detok.flush()
    assert out == "hi"


def test_invalid_bytes_do_not_block_forever():
    tk = byte_tokenizer()
    detok = IncrementalDetokenizer(tk)
    # A lone continuation byte cannot ever complete; the next valid text releases it.
    first = detok.push([0x80])
    later = detok.push([ord("a")]) + detok.flush()
    assert first + later == "\ufffda"


@pytest.mark.parametrize("make", [byte_tokenizer, window_path_tokenizer])
@pytest.mark.parametrize("cut", [1, 2, 3])
def test_a_cut_inside_a_character_drops_its_bytes(make, cut):
    """max_tokens ends the reply after `cut` of the emoji's 4 bytes: the reply ends before
    it, with no U+FFFD, streamed in any batching."""
    tk = make()
    ids = tk.encode("ok 😀")[:3 + cut]
    for sizes in ([1] * len(ids), [len(ids)], [2, 3]):
        deltas = stream(IncrementalDetokenizer(tk), ids, sizes)
        assert "".join(deltas) == "ok "


@pytest.mark.parametrize("make", [byte_tokenizer, window_path_tokenizer])
def test_a_cut_before_a_special_token_still_drops_the_partial_character(make):
    tk = make()
    ids = tk.encode("é")[:1] + [257]  # half of é, then EOS (skipped)
    detok = IncrementalDetokenizer(tk)
    assert detok.push(ids) + detok.flush() == ""


def test_byte_path_keeps_a_real_replacement_character():
    tk = byte_tokenizer()
    ids = tk.encode("a\ufffd")  # U+FFFD the model meant to say: whole bytes EF BF BD
    detok = IncrementalDetokenizer(tk)
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == "a\ufffd"


def test_sentencepiece_byte_fallback_cut():
    """A sentencepiece-style vocabulary (byte fallback pieces <0xNN>): a cut after two of
    the emoji's four byte pieces drops them instead of showing two U+FFFD; a U+FFFD piece
    the model chose stays."""
    from tokenizers import Tokenizer, decoders, models

    from zeroserve.gateway.text.tokenizer import TextTokenizer

    pieces = ["<unk>", "▁ok"] + [f"<0x{b:02X}>" for b in range(256)] + ["\ufffd"]
    tk = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>",
                              byte_fallback=True))
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse()])
    text_tk = TextTokenizer(tk, None, None, (), None, 4096, is_byte_level=False)
    emoji = [2 + b for b in "😀".encode()]
    assert text_tk.decode([1] + emoji) == " ok😀"
    assert text_tk.token_bytes(emoji[0]) == b"\xf0"
    detok = IncrementalDetokenizer(text_tk)
    out = detok.push([1]) + detok.push(emoji[:1]) + detok.push(emoji[1:2]) + detok.flush()
    assert out == " ok"
    detok = IncrementalDetokenizer(text_tk)
    assert detok.push([1] + emoji) + detok.flush() == " ok😀"
    detok = IncrementalDetokenizer(text_tk)
    assert detok.push([1, len(pieces) - 1]) + detok.flush() == " ok\ufffd"


class _RawBytesVocabulary:
    """A byte-level vocabulary given as its bytes table (token id -> bytes): tokens that are
    whole characters, pieces of one, several characters, invalid bytes."""

    is_byte_level = True

    def __init__(self, table: list[bytes]):
        self.table = table

    def shown_bytes_table(self) -> list[bytes]:
        return self.table

    bytes_table = shown_bytes_table

    def is_special(self, token_id: int) -> bool:
        return False


def _random_vocabulary(rng: random.Random) -> list[bytes]:
    chars = "aZ é日😀\u2028\ufffd€"
    table = [b"", b"\x80", b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
             b"\xe6\x97", b"\xa5", b"\xf0\x9f", b"\x98\x80"]
    for _ in range(60):
        data = "".join(rng.choice(chars) for _ in range(rng.randint(1, 3))).encode()
        cut = sorted(rng.sample(range(len(data) + 1), 2))
        table.append(data[cut[0]:cut[1]] or data)  # whole, or any slice of it
    return table


def test_byte_path_gives_the_codecs_text_for_random_bytes():
    """The byte path decodes whole UTF-8 at once when nothing is held: over random token
    sequences of whole characters, split characters and invalid bytes, in random batches,
    every delta is the one Python's incremental UTF-8 decoder (errors="replace") gives for
    the same bytes, and nothing held shows at the end."""
    import codecs

    rng = random.Random(36)
    for _ in range(300):
        vocabulary = _RawBytesVocabulary(_random_vocabulary(rng))
        detok = IncrementalDetokenizer(vocabulary)
        reference = codecs.getincrementaldecoder("utf-8")(errors="replace")
        ids = [rng.randrange(len(vocabulary.table) + 2) for _ in range(rng.randint(1, 40))]
        i = 0
        while i < len(ids):
            batch = ids[i:i + rng.choice((1, 1, 1, 2, 3))]
            i += len(batch)
            data = b"".join(vocabulary.table[t] if t < len(vocabulary.table) else b""
                            for t in batch)
            assert detok.push(batch) == reference.decode(data), (ids, batch)
        assert detok.flush() == ""
