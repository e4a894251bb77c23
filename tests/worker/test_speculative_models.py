"""n-gram speculative decoding on real forwards: greedy tokens with speculation equal the tokens
without it, on tiny random models of each architecture (fp32, paged KV in small blocks,
chunked prefill), alone and in a batch, for prompts that repeat themselves so that drafts
are proposed and some accepted. Seeded sampling gives the same tokens too (each row is drawn
with its position's (seed, n) uniform, worker/verify.py)."""

from __future__ import annotations

import pytest

from tests.worker.arch_models import make_model, one_thread  # noqa: F401 - autouse
from zeroserve.worker.config import EngineConfig
from zeroserve.worker.engine import Engine
from zeroserve.worker.sequence import SamplingParams
from zeroserve.worker.speculative import SpeculativeConfig

NUM_TOKENS = 32
_TEXT = [1, 17, 250, 3, 99, 42, 8, 7, 128, 64, 5, 31]
# Input-grounded: each prompt repeats a passage, so its n-grams recur (drafts), plus one
# that does not repeat (no drafts: it decodes normally beside the others).
PROMPTS = [_TEXT * 3, [1, 9, 8, 7] * 5 + [1, 9], [1, *range(30, 46)], _TEXT[:7] * 2]
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


def engine_for(path, speculative: SpeculativeConfig | None) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", block_size=4,
                               num_kv_blocks=256, max_num_batched_tokens=16,
                               max_model_len=256, weight_cache=False,
                               speculative_config=speculative))


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_model(request.param).save_pretrained(path, safe_serialization=True)
    return path


def test_greedy_tokens_are_the_same_with_speculation(model_dir):
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)
    plain = engine_for(model_dir, None)
    expected = plain.generate(PROMPTS, greedy)
    spec = engine_for(model_dir, SPEC)
    assert spec.generate(PROMPTS, greedy) == expected  # batched together
    assert spec.generate([PROMPTS[0]], greedy) == [expected[0]]  # and alone
    stats = spec.stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    # Rejected drafts gave their blocks back: nothing is held once all is done.
    bm = spec.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_seeded_sampling_and_logprobs_are_the_same_with_speculation(model_dir):
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=7 + i, max_tokens=NUM_TOKENS,
                             repetition_penalty=1.1 if i == 1 else 1.0, logprobs=2)
              for i in range(len(PROMPTS))]

    def run(engine: Engine) -> list[tuple[list[int], list]]:
        results = {}
        for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
            engine.add_request(f"s{i}", p, sp)
        while engine.has_unfinished():
            for out in engine.step():
                tokens, logprobs = results.setdefault(out.request_id, ([], []))
                tokens += out.new_token_ids
                logprobs += out.logprobs or []
        return [results[f"s{i}"] for i in range(len(PROMPTS))]

    expected = run(engine_for(model_dir, None))
    got = run(engine_for(model_dir, SPEC))
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (tokens, logprobs), (_, want) in zip(got, expected, strict=True):
        assert len(logprobs) == len(tokens)  # one entry per token, accepted drafts included
        assert [lp for lp, _ in logprobs] == pytest.approx([lp for lp, _ in want], abs=1e-4)


PASSAGE = ("The committee met on Tuesday to review the budget. After a long discussion, the "
           "members agreed to fund the new library, repair the bridge on Mill Street, and "
           "hire two more teachers for the primary school.")
GROUNDED = [f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
            f"Rewrite this text in the past tense:\n\n{PASSAGE}",
            f"List the three things the members agreed to in this text:\n\n{PASSAGE}"]


@pytest.mark.slow
def test_real_model_greedy_tokens_are_the_same_with_speculation():
    """The default model on the production path (bfloat16, low-bit decode kernels, native
    decode attention where it builds): input-grounded prompts, greedy, alone and in a batch
    beside unrelated requests, with and without n-gram speculation (its default settings,
    adaptive draft lengths included)."""
    from tests.worker.conftest import default_reference_tokenizer, encode_prompts

    tokenizer = default_reference_tokenizer()
    prompts = encode_prompts(tokenizer, ["Once upon a time,"], GROUNDED[:2])

    def engine(speculative: SpeculativeConfig | None) -> Engine:
        return Engine(EngineConfig(device="cpu", num_kv_blocks=512, max_model_len=1024,
                                   speculative_config=speculative))

    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    plain = engine(None)
    expected_batch = plain.generate(prompts, greedy)
    expected_alone = plain.generate([prompts[1]], greedy)
    del plain
    spec = engine(SpeculativeConfig())  # the default `zeroserve serve` runs
    assert spec.generate(prompts, greedy) == expected_batch
    assert spec.generate([prompts[1]], greedy) == expected_alone
    stats = spec.stats().spec_decode
    assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens  # input-grounded
    # Accepted drafts made the proposals grow past the first two (worker/draft_policy.py).
    assert len(stats.num_accepted_tokens_per_pos) > 2
