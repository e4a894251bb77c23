"""Engines sharing a KV tier on a tiny model: what one engine computed, another loads instead of
computing, and the tokens are exactly those the first engine gave (and those replay gives).

A stream moved from a lost worker arrives as prompt + the tokens it produced; the second engine
finds its blocks in the tier, computes only the tail, and continues with the same tokens."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from tests.worker.arch_models import (
    make_model,
    one_thread,  # noqa: F401 - autouse
    write_gguf,
)
from zeroserve.worker.config import EngineConfig
from zeroserve.worker.engine import Engine
from zeroserve.worker.sequence import SamplingParams

_rng = random.Random(37)
PROMPT = [_rng.randrange(3, 250) for _ in range(90)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=11, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    model = make_model("llama", seed=4)
    return write_gguf(model, tmp_path_factory.mktemp("tier") / "tiny.gguf")


def engine(model: Path, tier: Path | None, **overrides) -> Engine:
    tier_fields = {} if tier is None else dict(kv_offloading_size=0.01,
                                               kv_offloading_dir=str(tier))
    return Engine(EngineConfig(**{**dict(
        model=str(model), device="cpu", dtype="float32", block_size=16, num_kv_blocks=64,
        max_model_len=256, max_num_batched_tokens=32, weight_cache=False),
        **tier_fields, **overrides}))


def run(engine: Engine, prompt: list[int], params: SamplingParams,
        outputs: list[int] = ()) -> tuple[list[int], int]:
    """The new tokens of one request, and how many of its prompt tokens were cached."""
    request_id = f"r{engine.stats().num_steps}"
    engine.add_request(request_id, prompt, params, output_token_ids=list(outputs))
    tokens, cached = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    return tokens, cached


@pytest.mark.parametrize("pool_in_tier", [True, False], ids=["pool-in-tier", "copied"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_moved_stream_continues_from_the_tier_with_the_same_tokens(tiny_gguf, tmp_path,
                                                                       params, pool_in_tier):
    first = engine(tiny_gguf, tmp_path / "tier", kv_pool_in_tier=pool_in_tier)
    # The CPU pool lives in the tier (its blocks published without a copy) unless turned off.
    assert (first.runner.kv_pool_file is not None) == pool_in_tier
    assert (first.tier.pool_file is not None) == pool_in_tier
    expected, _ = run(first, PROMPT, params)
    first.tier.close()  # everything written (a killed worker's last blocks may be missing)
    assert first.tier.counters.num_puts >= (len(PROMPT) + len(expected)) // 16 - 1

    sent = expected[:25]  # the tokens the client had when the first worker died
    second = engine(tiny_gguf, tmp_path / "tier", kv_pool_in_tier=pool_in_tier)
    rest, _ = run(second, PROMPT, params, outputs=sent)
    assert sent + rest == expected
    counters = second.tier.counters
    assert counters.num_hits == (len(PROMPT) + len(sent) - 1) // 16  # all but the tail
    assert second.block_manager.num_tier_hit_tokens == counters.num_hits * 16

    replay, _ = run(engine(tiny_gguf, None), PROMPT, params, outputs=sent)
    assert replay == rest  # what replay gives, without a tier


@pytest.mark.slow
def test_on_the_default_model_a_moved_stream_continues_with_the_same_tokens(tmp_path):
    """The real model as served (`--dtype auto`: int8 activations, a bf16 KV cache on the
    CPU), greedy and seeded: the stream moved after 25 tokens gives, from the tier and by
    replay, exactly the undisturbed run's tokens and logprobs (its produced tokens computed
    again as decode rows; as prompt rows they rounded differently, which could flip a
    near-tie)."""
    from zeroserve.common.model_files import default_model_path

    model = default_model_path()
    kinds = {"greedy": dataclasses.replace(GREEDY, logprobs=1),
             "seeded": dataclasses.replace(SEEDED, logprobs=1)}

    def real(tier: Path | None) -> Engine:
        return engine(model, tier, dtype="auto", num_kv_blocks=128, max_model_len=512,
                      max_num_batched_tokens=64)

    def generate(eng: Engine, params: SamplingParams, outputs: list[int] = ()):
        request_id = f"r{eng.stats().num_steps}"
        eng.add_request(request_id, prompt, params, output_token_ids=list(outputs))
        tokens, logprobs = list(outputs), []
        while eng.has_unfinished():
            for out in eng.step():
                tokens += out.new_token_ids
                logprobs += out.logprobs or []
        return tokens, logprobs

    rng = random.Random(7)
    prompt = [rng.randrange(100, 40000) for _ in range(70)]
    first = real(tmp_path / "tier")
    expected = {kind: generate(first, params) for kind, params in kinds.items()}
    first.tier.close()
    second, replay = real(tmp_path / "tier"), real(None)
    for kind, params in kinds.items():
        tokens, logprobs = expected[kind]
        for eng in (second, replay):
            moved = generate(eng, params, tokens[:25])
            assert moved == (tokens, logprobs[25:]), kind
    assert second.tier.counters.num_hits > 0


def test_a_prefix_another_worker_computed_is_loaded_not_computed(tiny_gguf, tmp_path):
    first = engine(tiny_gguf, tmp_path / "tier")
    expected, _ = run(first, PROMPT, GREEDY)
    first.tier.close()
    second = engine(tiny_gguf, tmp_path / "tier")
    tokens, cached = run(second, PROMPT, GREEDY)
    assert tokens == expected
    assert cached == len(PROMPT) // 16 * 16  # usage reports the prompt tokens it did not compute
    # The prefill computed only the tail: fewer tokens than the prompt, through the steps.
    assert second.tier.counters.num_hits == len(PROMPT) // 16


def test_bad_blocks_in_the_tier_cost_a_recompute_never_a_wrong_token(tiny_gguf, tmp_path):
    first = engine(tiny_gguf, tmp_path / "tier")
    expected, _ = run(first, PROMPT, GREEDY)
    first.tier.close()
    blocks = sorted((tmp_path / "tier").glob("*.kv"))
    for n, path in enumerate(blocks):  # every block torn: a flipped payload byte
        data = bytearray(path.read_bytes())
        data[-1 - n] ^= 0x40
        path.write_bytes(bytes(data))
    second = engine(tiny_gguf, tmp_path / "tier")
    tokens, cached = run(second, PROMPT, GREEDY)
    assert tokens == expected
    assert cached == 0
    assert second.tier.counters.num_bad >= 1
    assert second.tier.counters.num_hits == 0


def test_another_model_never_reads_the_blocks(tiny_gguf, tmp_path, tmp_path_factory):
    first = engine(tiny_gguf, tmp_path / "tier")
    run(first, PROMPT, GREEDY)
    first.tier.close()
    other_file = write_gguf(make_model("llama", seed=5),
                            tmp_path_factory.mktemp("other") / "tiny.gguf")
    other = engine(other_file, tmp_path / "tier")
    expected, _ = run(engine(other_file, None), PROMPT, GREEDY)
    tokens, cached = run(other, PROMPT, GREEDY)
    assert tokens == expected and cached == 0
    assert other.tier.counters.num_hits == 0


def test_the_tier_is_off_where_its_folder_cannot_hold_it(tiny_gguf, tmp_path, monkeypatch,
                                                         caplog):
    from zeroserve.worker.kv_tier import setup

    monkeypatch.setattr(setup, "_file_system_bytes", lambda folder: 64 << 20)  # a 64 MiB shm
    small = engine(tiny_gguf, tmp_path / "tier", kv_offloading_size=1.0)
    assert small.tier is None
    assert "the tier is off" in caplog.text
    tokens, _ = run(small, PROMPT, GREEDY)
    assert len(tokens) == GREEDY.max_tokens  # and the worker serves
