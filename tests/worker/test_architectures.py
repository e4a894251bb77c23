"""Every supported architecture against transformers in fp32, token for token: tiny random
models of each (Llama, Llama 3 rope scaling, Mistral's sliding window, Qwen2's biases and
windowed layers, Qwen3's Q/K norms and wide heads), from a HF directory and from GGUF, run
through the engine (scheduler, paged KV cache in small blocks, chunked prefill, batching)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.worker.arch_models import (
    VARIANTS,
    hf_greedy,
    make_model,
    one_thread,  # noqa: F401 - autouse
    write_gguf,
)
from zeroserve.worker.config import EngineConfig
from zeroserve.worker.engine import Engine
from zeroserve.worker.model.hf_weights import read_config
from zeroserve.worker.model.llama_config import UnsupportedModelError
from zeroserve.worker.model.loader import load_model
from zeroserve.worker.sequence import SamplingParams

NUM_TOKENS = 24
# Lengths around the block size (4) and prefill chunk (8); 17 + 24 tokens run far past the
# 5- and 6-token windows.
PROMPTS = [[1, 17, 250, 3, 99, 42, 42, 7, 128, 64, 5], [1, 9, 8, 7],
           [1, *range(30, 46)]]


def engine_for(path, **overrides) -> Engine:
    fields = dict(model=str(path), device="cpu", dtype="float32", block_size=4,
                  num_kv_blocks=128, max_num_batched_tokens=8, max_model_len=256,
                  weight_cache=False)
    return Engine(EngineConfig(**{**fields, **overrides}))


def assert_same_greedy(engine: Engine, expected: list[list[int]]) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)
    assert engine.generate(PROMPTS, greedy) == expected  # all batched together
    assert engine.generate([PROMPTS[2]], greedy) == [expected[2]]  # and alone


@pytest.fixture(scope="module")
def reference():
    """variant name -> (make_model(name), transformers' greedy tokens for PROMPTS), each
    computed once (make_model is deterministic)."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            model = make_model(name)
            cache[name] = model, [hf_greedy(model, p, NUM_TOKENS) for p in PROMPTS]
        return cache[name]

    return get


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, reference):
    return request.param, *reference(request.param)


def test_hf_directory_greedy_matches_transformers(variant, tmp_path):
    name, model, expected = variant
    model.save_pretrained(tmp_path / name, safe_serialization=True)
    engine = engine_for(tmp_path / name)
    assert engine.runner.model.config.architecture == name.split("-")[0].replace("llama3", "llama")
    assert_same_greedy(engine, expected)


# Every variant but Qwen2's per-layer windows, which GGUF has no key for.
@pytest.mark.parametrize("name", [v for v in VARIANTS if v != "qwen2-window"])
def test_gguf_greedy_matches_transformers(name, tmp_path, reference):
    model, expected = reference(name)
    assert_same_greedy(engine_for(write_gguf(model, tmp_path / f"{name}.gguf")), expected)


def test_the_differences_matter(tmp_path, reference):
    """Each variant's difference changes the tokens: without it the same weights give other
    text, so the tests above hold each feature, not just plain Llama."""
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)
    llama3, expected = reference("llama3")
    no_freqs = write_gguf(llama3, tmp_path / "no-freqs.gguf", rope_freqs=False)
    assert engine_for(no_freqs).generate(PROMPTS, greedy) != expected
    mistral, expected = reference("mistral")
    no_window = write_gguf(mistral, tmp_path / "no-window.gguf", sliding_window=False)
    assert engine_for(no_window).generate(PROMPTS, greedy) != expected


def test_llama3_config_in_the_released_layout():
    """Llama 3.1's config.json: rope_scaling beside a top-level rope_theta."""
    config = read_config({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    })
    assert (config.rope_type, config.rope_scaling_factor, config.rope_theta) == (
        "llama3", 8.0, 500000.0)
    assert config.rope_original_max_position == 8192 and config.head_dim == 128


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"model_type": "gpt2"}, "gpt2"),
    ({"hidden_act": "gelu"}, "gelu"),
])
def test_unsupported_configs_are_refused_clearly(tmp_path, change, message):
    model = make_model("llama")
    model.save_pretrained(tmp_path, safe_serialization=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32)


def test_weights_the_model_would_ignore_are_refused(tmp_path):
    """A Qwen2 checkpoint relabelled as Llama still carries q/k/v biases (taken), but an extra
    unknown tensor would be dropped silently: refused instead."""
    from safetensors.torch import load_file, save_file

    model = make_model("llama")
    model.save_pretrained(tmp_path, safe_serialization=True)
    file = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(str(file))
    tensors["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(128)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="gate_proj.bias"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32)


@pytest.mark.cuda
def test_greedy_matches_transformers_on_a_gpu(variant, tmp_path):
    name, model, expected = variant
    model.save_pretrained(tmp_path / name, safe_serialization=True)
    assert_same_greedy(engine_for(tmp_path / name, device="cuda"), expected)


def test_a_missing_tensor_is_a_clear_error(tmp_path):
    """A Qwen3 checkpoint without its q/k norms cannot run: refused, naming the tensor."""
    from safetensors.torch import load_file, save_file

    model = make_model("qwen3")
    model.save_pretrained(tmp_path, safe_serialization=True)
    file = next(tmp_path.glob("*.safetensors"))
    tensors = {k: v for k, v in load_file(str(file)).items() if "q_norm" not in k}
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="qwen3 model file has no tensor "
                                                    "model.layers.0.self_attn.q_norm.weight"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("name, file", [("qwen2-window", "hf"), ("llama3", "gguf"),
                                        ("qwen3", "gguf")])
def test_weight_cache_keeps_what_each_architecture_needs(name, file, tmp_path, reference):
    """Windows per layer, rope factors, biases and norms survive the weight cache: a start
    that maps it generates what transformers does."""
    model, expected = reference(name)
    if file == "hf":
        model.save_pretrained(tmp_path / name, safe_serialization=True)
        path = tmp_path / name
    else:
        path = write_gguf(model, tmp_path / f"{name}.gguf")
    cache = dict(weight_cache=True, weight_cache_dir=str(tmp_path / "cache"))
    assert "quantize" in engine_for(path, **cache).startup_phases  # built, then written
    mapped = engine_for(path, **cache)
    assert mapped.startup_phases.get("quantize") is None  # nothing was rebuilt
    assert_same_greedy(mapped, expected)
