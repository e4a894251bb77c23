"""Speculative decoding with a grammar: drafts are cut at the first token the grammar
forbids, each verification row is masked by the grammar state after the drafts before it,
and the matcher gives back what rejected drafts made it consume. On an input-grounded
stand-in for a model (its logits favour copying the context) with the real sampler and
matcher: the same tokens as decoding without speculation, and a valid output."""

from __future__ import annotations

import json

import pytest
import torch

from tests.worker.test_grammar import EOS, VOCAB
from zeroserve.common.model_files import default_model_path
from zeroserve.worker import verify
from zeroserve.worker.grammar import GGUFVocabulary, GrammarCompiler, GrammarSpec
from zeroserve.worker.plan import ScheduledChunk
from zeroserve.worker.sampler import Sampler
from zeroserve.worker.sequence import SamplingParams
from zeroserve.worker.speculative import propose_ngram

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "city": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
EXAMPLES = ('{"name": "Ann", "city": "Oslo", "age": 31}\n'
            '{"name": "Bob", "city": "Rome", "age": 42}\n')


@pytest.fixture(scope="module")
def vocabulary() -> GGUFVocabulary:
    return GGUFVocabulary.read(default_model_path(), [EOS])


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(default_model_path(), VOCAB, (EOS,))


def logits_for(context: list[int], position: int, seed: int) -> torch.Tensor:
    """[1, VOCAB]: noise fixed by the position, plus a pull towards what followed the
    latest earlier occurrence of the last 4 tokens (or fewer): a model copying its
    input. (The proposer looks for up to 2: its drafts are sometimes wrong.)"""
    torch.manual_seed(seed * 1000 + position)
    logits = torch.randn(1, VOCAB) * 2
    follow = propose_ngram(context, 1, 4, 1)
    if follow:
        logits[0, follow[0]] += 12
    return logits


def decode_loop(sampler: Sampler, prompt: list[int], params: SamplingParams, seed: int,
                speculate: bool) -> tuple[list[int], int]:
    """Tokens until EOS or max_tokens, and how many drafts were accepted."""
    out: list[int] = []
    num_accepted = 0
    while len(out) < params.max_tokens and (not out or out[-1] != EOS):
        drafts: list[int] = []
        if speculate:
            k = min(4, params.max_tokens - len(out) - 1)
            drafts = propose_ngram(prompt + out, 1, 2, k)
            drafts = drafts[:params.grammar.num_allowed(out, drafts)] if drafts else []
        chunk = ScheduledChunk("r", [1, *drafts], 5, [0], True, params, prompt, list(out),
                               draft_token_ids=drafts or None)
        rows, counts = verify.expand([chunk])
        sampler.prepare(rows)
        logits = torch.cat([logits_for(prompt + r.output_token_ids, len(r.output_token_ids),
                                       seed) for r in rows])
        [token] = verify.accept([chunk], counts, sampler.sample(logits, rows))
        accepted = token.accepted_token_ids or []
        num_accepted += len(accepted)
        for t in (*accepted, token.token_id):
            out.append(t)
            if t == EOS or len(out) == params.max_tokens:
                break
    return out, num_accepted


@pytest.mark.parametrize("temperature, seed", [(0.0, 1), (0.0, 2), (0.7, 4)])
def test_constrained_speculation_gives_the_same_valid_output(compiler, vocabulary,
                                                             temperature, seed):
    sampler = Sampler(VOCAB, (EOS,), torch.device("cpu"))
    prompt = list(vocabulary(EXAMPLES))
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))

    def params() -> SamplingParams:
        return SamplingParams(max_tokens=64, temperature=temperature, seed=seed,
                              grammar=compiler.attach(spec))

    plain, _ = decode_loop(sampler, prompt, params(), seed, speculate=False)
    fast, num_accepted = decode_loop(sampler, prompt, params(), seed, speculate=True)
    assert fast == plain
    assert num_accepted > 0
    if temperature == 0.0:  # (a draw can leave the copied text: then 64 tokens run out)
        assert plain[-1] == EOS
        value = json.loads(b"".join(vocabulary.tokens[i] for i in plain[:-1]).decode())
        assert set(value) == {"name", "age", "city"} and type(value["age"]) is int


def test_the_matcher_gives_back_rejected_drafts(compiler, vocabulary):
    state = compiler.attach(GrammarSpec("regex", "(ab|cd)+x"))
    ab, cd, x = (vocabulary(t)[0] for t in ("ab", "cd", "x"))
    assert state.num_allowed([], [ab, cd, ab, 999]) == 3  # cut at the forbidden token
    state.sync([ab, cd, ab])  # a row's view: two drafts consumed beyond [ab]
    state.sync([ab, x])  # the drafts were rejected; x followed instead
    assert state.failed is None and state.matcher.is_stopped()
    state.sync([ab, cd])  # and back again, to a state the grammar still allows
    assert state.failed is None and not state.matcher.is_stopped()
    assert state.num_allowed([ab, cd], [x]) == 1
