"""The weight cache on a tiny GGUF model: a hit gives the very weights and tokens of a fresh
load; a damaged, cut-short or stale file is rebuilt, never used; workers starting together
build once; a cache that cannot be written never stops a start."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import gguf
import pytest
import torch

from tests.worker.conftest import make_tiny_hf_model, write_gguf
from zeroserve.worker.config import EngineConfig
from zeroserve.worker.engine import Engine
from zeroserve.worker.model.loader import prepared_weights
from zeroserve.worker.model.prepare import BLOCKS, INT4, packing
from zeroserve.worker.sequence import SamplingParams
from zeroserve.worker.startup import StartupTimer
from zeroserve.worker.weight_cache import WeightCache

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
PROMPTS = [[1, 5, 9, 200, 17], [1, 44, 3, 3, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
# bf16 takes torch's int4 / int8 copies where the kernels exist; fp32 the file's own blocks
# for the native kernels where they build.
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory) -> Path:
    return write_gguf(make_tiny_hf_model(seed=7), tmp_path_factory.mktemp("wc") / "tiny.gguf",
                      Q.Q4_1)


def load(model: Path, cache: WeightCache | None, dtype: torch.dtype):
    """(prepared weights, the timer's weight_cache note)."""
    timer = StartupTimer()
    prepared = prepared_weights(model, CPU, dtype, cache, timer)
    return prepared, timer.notes["weight_cache"]


def assert_same_weights(a, b) -> None:
    assert a.config == b.config
    assert (a.eos_token_ids, a.bos_token_id) == (b.eos_token_ids, b.bos_token_id)
    assert a.tensors.keys() == b.tensors.keys()
    for name, tensor in a.tensors.items():
        other = b.tensors[name]
        assert tensor.dtype == other.dtype and torch.equal(tensor, other), name


def engine_tokens(model: Path, cache_dir: Path | None, dtype: str) -> tuple[list, Engine]:
    config = EngineConfig(model=str(model), device="cpu", dtype=dtype, num_kv_blocks=32,
                          block_size=4, attention_backend="torch",
                          weight_cache=cache_dir is not None,
                          weight_cache_dir=None if cache_dir is None else str(cache_dir))
    engine = Engine(config)
    return engine.generate(PROMPTS, GREEDY), engine


def the_file(cache_dir: Path) -> Path:
    (path,) = cache_dir.glob("*.pt")
    return path


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_hit_gives_the_weights_of_a_fresh_load(q4_model, tmp_path, dtype):
    cache = WeightCache(tmp_path)
    fresh, note = load(q4_model, None, dtype)
    assert note == "off"
    built, note = load(q4_model, cache, dtype)
    assert note.startswith("miss") and the_file(tmp_path).stat().st_size > 0
    mapped, note = load(q4_model, cache, dtype)
    assert note.startswith("hit")
    assert_same_weights(built, fresh)
    assert_same_weights(mapped, fresh)
    if packing(CPU, dtype) == INT4:
        assert any(name.endswith(".int4.weight") for name in mapped.tensors)
        assert "lm_head.int8.weight" in mapped.tensors
    if packing(CPU, dtype) == BLOCKS:
        assert any(name.endswith(".q4.blocks") for name in mapped.tensors)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cached_start_generates_the_tokens_of_an_uncached_one(q4_model, tmp_path, dtype):
    expected, _engine = engine_tokens(q4_model, None, dtype)
    first, engine = engine_tokens(q4_model, tmp_path, dtype)  # builds the file
    second, engine = engine_tokens(q4_model, tmp_path, dtype)  # maps it
    assert first == second == expected
    phases = engine.startup_phases
    assert {"import", "load_weights", "model", "kv_cache", "kernel", "total"} <= phases.keys()
    assert "quantize" not in phases  # a hit prepares nothing
    assert all(isinstance(s, float) and s >= 0 for s in phases.values())


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        del data[len(data) // 2:]
    elif how == "flipped":  # a bit in the middle of the tensor data, archive intact
        data[len(data) // 2] ^= 0x10
    elif how == "garbage":
        data[:] = os.urandom(len(data))
    elif how == "empty":
        data.clear()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "flipped", "garbage", "empty"])
def test_a_damaged_file_is_rebuilt_never_used(q4_model, tmp_path, how, caplog):
    cache = WeightCache(tmp_path)
    fresh, _ = load(q4_model, None, torch.float32)
    load(q4_model, cache, torch.float32)
    damage(the_file(tmp_path), how)
    rebuilt, note = load(q4_model, cache, torch.float32)
    assert note.startswith("miss")
    assert "damaged" in caplog.text
    if how == "flipped":  # the archive still reads: the checksums catch it
        assert "checksum mismatch" in caplog.text
    assert_same_weights(rebuilt, fresh)
    again, note = load(q4_model, cache, torch.float32)  # and the rebuilt file is good
    assert note.startswith("hit")
    assert_same_weights(again, fresh)


def test_a_changed_model_file_invalidates_its_entry(tmp_path):
    model = write_gguf(make_tiny_hf_model(seed=1), tmp_path / "m.gguf", Q.Q4_1)
    cache = WeightCache(tmp_path / "cache")
    old, _ = load(model, cache, torch.float32)
    write_gguf(make_tiny_hf_model(seed=2), model, Q.Q4_1)  # same name and size, new weights
    new, note = load(model, cache, torch.float32)
    assert note.startswith("miss")
    fresh, _ = load(model, None, torch.float32)
    assert_same_weights(new, fresh)
    assert not torch.equal(new.tensors["embed"], old.tensors["embed"])
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 1  # replaced, not left behind


def test_entries_are_kept_apart_by_dtype(q4_model, tmp_path):
    cache = WeightCache(tmp_path)
    fp32, _ = load(q4_model, cache, torch.float32)
    bf16, _ = load(q4_model, cache, torch.bfloat16)
    assert len(list(tmp_path.glob("*.pt"))) == 2
    assert load(q4_model, cache, torch.float32)[0].tensors["embed"].dtype == torch.float32
    assert load(q4_model, cache, torch.bfloat16)[0].tensors["embed"].dtype == torch.bfloat16


def test_workers_starting_together_build_once(q4_model, tmp_path):
    cache = WeightCache(tmp_path)
    results: list = [None] * 3

    def start(i: int) -> None:
        results[i] = load(q4_model, cache, torch.bfloat16)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    notes = [note.split()[0] for _prepared, note in results]
    assert sorted(notes) == ["hit", "hit", "miss"]
    for prepared, _note in results[1:]:
        assert_same_weights(prepared, results[0][0])
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_an_unwritable_cache_never_stops_a_start(q4_model, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    fresh, _ = load(q4_model, None, torch.float32)
    prepared, note = load(q4_model, WeightCache(blocker / "cache"), torch.float32)
    assert_same_weights(prepared, fresh)
    assert "weight cache" in caplog.text


def test_the_kv_pool_starts_zeroed_without_a_fill(q4_model, tmp_path):
    _tokens, engine = engine_tokens(q4_model, tmp_path, "float32")
    fresh = Engine(EngineConfig(model=str(q4_model), device="cpu", dtype="float32",
                                num_kv_blocks=32, block_size=4, weight_cache_dir=str(tmp_path)))
    k, v = fresh.runner.kv_caches[-1]
    assert k.shape == (32, 4, 2, 16) and k.is_contiguous()
    assert not k.any() and not v.any()
    assert engine.runner.kv_caches[0][0].any()  # the engine that generated wrote its pool


@pytest.mark.slow  # three loads of the real model, two of them parsing the GGUF file
def test_the_default_model_from_the_cache_generates_what_a_fresh_load_does(tmp_path):
    prompts = [[1, 504, 3204, 314, 260, 2156], [1, 9690, 28, 1001]]
    params = SamplingParams(temperature=0.0, max_tokens=16)

    def engine(**cache) -> Engine:
        return Engine(EngineConfig(device="cpu", num_kv_blocks=64, **cache))

    fresh = engine(weight_cache=False).generate(prompts, params)
    built = engine(weight_cache_dir=str(tmp_path)).generate(prompts, params)
    mapped_engine = engine(weight_cache_dir=str(tmp_path))
    assert "quantize" not in mapped_engine.startup_phases  # a hit
    assert mapped_engine.generate(prompts, params) == built == fresh
