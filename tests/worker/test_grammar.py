"""Constrained decoding in the worker: the vocabulary llguidance sees, the sampler's masks
(whatever the logits say, only what the grammar allows comes out), the grammar cache, the
resumption of a failed-over stream, and logit_bias."""

from __future__ import annotations

import json
import re

import pytest
import torch

from zeroserve.common.model_files import default_model_path
from zeroserve.worker.engine import Engine
from zeroserve.worker.fake_runner import FakeRunner
from zeroserve.worker.grammar import GGUFVocabulary, GrammarCompiler, GrammarError, GrammarSpec
from zeroserve.worker.plan import ScheduledChunk
from zeroserve.worker.sampler import Sampler
from zeroserve.worker.sequence import RequestError, SamplingParams

VOCAB = 49152
EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def vocabulary() -> GGUFVocabulary:
    return GGUFVocabulary.read(default_model_path(), [EOS])


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(default_model_path(), VOCAB, (EOS,))


def test_gguf_vocabulary_spells_tokens_as_bytes(vocabulary):
    from zeroserve.gateway.text.tokenizer import load_tokenizer

    reference = load_tokenizer("default")  # the gateway's tokenizer, built independently
    for text in ["Hello world", ' {"a": 1}\n', "naïve 日本"]:
        ids = reference.encode(text, add_special_tokens=False)
        assert b"".join(vocabulary.tokens[i] for i in ids) == text.encode()
    assert EOS in vocabulary.special_token_ids and vocabulary.tokens[EOS] == b"<|im_end|>"
    assert b"".join(vocabulary.tokens[i] for i in vocabulary("hello there")) == b"hello there"


def decode(vocabulary, ids: list[int]) -> str:
    return b"".join(vocabulary.tokens[i] for i in ids).decode()


def generate(sampler: Sampler, params: SamplingParams, max_tokens: int, seed: int = 0,
             prefix: list[int] | None = None) -> list[int]:
    """Sample from random logits with `params` until EOS (or max_tokens); the logits of the
    n-th output token depend only on (seed, n), like a model's on the text so far."""
    out = list(prefix or [])
    while len(out) < max_tokens:
        chunk = ScheduledChunk("r", [1], 5, [0], True, params, [1, 2, 3], list(out))
        sampler.prepare([chunk])
        torch.manual_seed(seed * 1000 + len(out))
        logits = torch.randn(1, VOCAB) * 5
        [token] = sampler.sample(logits, [chunk])
        out.append(token.token_id)
        if token.token_id == EOS:
            break
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_logits_still_follow_the_grammar(compiler, vocabulary, temperature):
    sampler = Sampler(VOCAB, (EOS,), torch.device("cpu"))
    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "tag": {"enum": ["x", "y"]}},
              "required": ["n", "tag"], "additionalProperties": False}
    for seed in range(3):
        state = compiler.attach(GrammarSpec("json_schema", json.dumps(schema)))
        params = SamplingParams(max_tokens=64, temperature=temperature, grammar=state)
        ids = generate(sampler, params, 64, seed)
        assert ids[-1] == EOS, decode(vocabulary, ids)  # the grammar ends the output
        value = json.loads(decode(vocabulary, ids[:-1]))
        assert set(value) == {"n", "tag"} and type(value["n"]) is int
        assert value["tag"] in ("x", "y")
    state = compiler.attach(GrammarSpec("regex", "[a-c]{2,4}-[0-9]{3}"))
    ids = generate(sampler, SamplingParams(max_tokens=32, temperature=temperature,
                                           grammar=state), 32)
    assert re.fullmatch("[a-c]{2,4}-[0-9]{3}", decode(vocabulary, ids[:-1]))


def test_a_resumed_stream_continues_its_grammar(compiler, vocabulary):
    """A stream that moved from another worker (its tokens so far handed over) continues as
    if it had never moved: same tokens, and the grammar state advanced over the handed-over
    ones (unconstrained at the start it would open a new object)."""
    sampler = Sampler(VOCAB, (EOS,), torch.device("cpu"))
    spec = GrammarSpec("json_schema", json.dumps({"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 999}, "minItems": 3, "maxItems": 3}))

    def params():
        return SamplingParams(max_tokens=40, temperature=0.0, grammar=compiler.attach(spec))

    full = generate(sampler, params(), 40, seed=7)
    assert len(json.loads(decode(vocabulary, full[:-1]))) == 3
    for cut in (1, len(full) // 2, len(full) - 2):
        assert generate(sampler, params(), 40, seed=7, prefix=full[:cut]) == full


def test_compiled_grammars_are_cached_and_states_independent(compiler):
    spec = GrammarSpec("regex", "[0-9]+")
    a, b = compiler.attach(spec), compiler.attach(GrammarSpec("regex", "[0-9]+"))
    assert a.matcher is not b.matcher and len([s for s in compiler._cache if s == spec]) == 1
    digit = next(i for i in range(VOCAB) if compiler.tokenizer.decode_str([i]) == "7")
    a.sync([digit])
    assert a.num_consumed == 1 and b.num_consumed == 0


def test_invalid_grammars_are_refused_with_a_message(compiler):
    with pytest.raises(GrammarError, match="invalid"):
        compiler.attach(GrammarSpec("json_schema", '{"type": "strin"}'))
    with pytest.raises(GrammarError):
        compiler.attach(GrammarSpec("regex", "(unclosed"))
    with pytest.raises(GrammarError):
        GrammarSpec("cfg", "x")
    with pytest.raises(GrammarError):
        GrammarSpec.from_wire(["regex", 5])


def test_engine_without_a_vocabulary_refuses_grammars():
    from tests.worker.factories import make_config

    engine = Engine(make_config(), runner=FakeRunner(make_config()))
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request("r", [1, 2], SamplingParams(), grammar=GrammarSpec("regex", "a"))
    assert not engine.has_unfinished()


def test_logit_bias_follows_openai():
    sampler = Sampler(100, (EOS,), torch.device("cpu"))
    logits = torch.zeros(3, 100)
    logits[:, 10] = 50.0
    chunks = [ScheduledChunk(f"r{i}", [1], 0, [0], True, SamplingParams(
        temperature=0.0, logit_bias=bias)) for i, bias in enumerate(
        [{}, {42: 100}, {10: -100, 11: 30}])]
    assert [t.token_id for t in sampler.sample(logits, chunks)] == [10, 42, 11]
    with pytest.raises(RequestError):
        SamplingParams(logit_bias={1: 101})
    assert SamplingParams(logit_bias=[[3, 1]]).logit_bias == ((3, 1.0),)


def test_masks_apply_to_any_logits_layout(compiler, vocabulary):
    """The torch path (GPU, or logits numpy cannot share) masks like the numpy path."""
    sampler = Sampler(VOCAB, (EOS,), torch.device("cpu"))
    for logits in (torch.randn(VOCAB, 2).t() * 5, torch.randn(2, VOCAB) * 5):  # strided, not
        chunks = [ScheduledChunk(f"r{i}", [1], 5, [0], True, SamplingParams(
            temperature=0.0, grammar=compiler.attach(GrammarSpec("regex", "[0-9]+")) if i else
            None)) for i in range(2)]
        sampler.prepare(chunks)
        free, constrained = sampler.sample(logits.clone(), chunks)
        assert free.token_id == int(logits[0].argmax())
        assert decode(vocabulary, [constrained.token_id]).isdigit()


def test_a_hugging_face_tokenizer_json_works_too(tmp_path):
    """A model directory's tokenizer.json (byte-level BPE, an EOS added token) as the
    vocabulary, with logits wider than the tokenizer (padded embeddings)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from zeroserve.gateway.text.tokenizer import byte_to_unicode

    spell = byte_to_unicode()
    tk = Tokenizer(models.BPE({spell[b]: b for b in range(256)}, [], fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken("<eos>", special=True, normalized=False)])  # id 256
    tk.save(str(tmp_path / "tokenizer.json"))
    width = 320
    compiler = GrammarCompiler(tmp_path, width, (256,))
    sampler = Sampler(width, (256,), torch.device("cpu"))
    for seed in range(3):
        state = compiler.attach(GrammarSpec("regex", "(ab|cd)[0-9]{2}"))
        out = []
        while not out or out[-1] != 256:
            chunk = ScheduledChunk("r", [1], 5, [0], True, SamplingParams(
                temperature=1.0, seed=seed, grammar=state), [1], list(out))
            torch.manual_seed(seed * 100 + len(out))
            [token] = sampler.sample(torch.randn(1, width) * 3, [chunk])
            out.append(token.token_id)
            assert len(out) < 10
        assert re.fullmatch("(ab|cd)[0-9]{2}", bytes(out[:-1]).decode())


def test_a_sentencepiece_gguf_vocabulary_spells_like_sentencepiece(tmp_path_factory):
    """tokenizer.ggml.model "llama" (Llama 2, Mistral): '▁' is a space, <0xNN> a byte."""
    pytest.importorskip("sentencepiece")
    from tests.gateway.text import test_tokenizer_sentencepiece as spm_tests

    spm = spm_tests.spm.__wrapped__()
    path = spm_tests.gguf_path.__wrapped__(spm, tmp_path_factory)
    vocabulary = GGUFVocabulary.read(path, [2])
    for text in ["Hello, world!", "Unseen: 日本語 😀", "line one\n\ttabbed  twice"]:
        ids = spm.encode(text)
        assert b"".join(vocabulary.tokens[i] for i in ids).decode() == " " + text
    assert {0, 1, 2} <= set(vocabulary.special_token_ids)  # unk, bos, eos


def test_masks_computed_during_the_forward_equal_those_computed_after(compiler):
    """The accelerator path (masks on a helper thread while the model runs) picks the same
    tokens as the CPU path (masks after the forward)."""
    from zeroserve.worker.sampler import GrammarMasks

    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"]}))
    runs = []
    for overlap in (False, True):
        sampler = Sampler(VOCAB, (EOS,), torch.device("cpu"))
        sampler._grammar_masks = GrammarMasks(overlap=overlap)
        params = SamplingParams(max_tokens=30, temperature=1.0, seed=1,
                                grammar=compiler.attach(spec))
        runs.append(generate(sampler, params, 30, seed=4))
    assert runs[0] == runs[1] and runs[0][-1] == EOS
