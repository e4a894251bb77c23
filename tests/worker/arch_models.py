"""Tiny random models of every supported architecture, built offline with transformers from a
config and written as a HF directory or as a GGUF file the way llama.cpp's converter lays one
out (an independent writer: Llama's Q/K rows permuted, Llama 3's rope factors as a
`rope_freqs` tensor, Qwen's biases and Q/K norms under llama.cpp's names).

Quantized GGUF tensors are random raw blocks of the type (gguf can quantize only some types);
the reference model then gets their dequantized values, so both sides compute with the same
weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.worker.conftest import add_gguf_hparams, gguf_name, permute_qk_like_llama_cpp

Q = gguf.GGMLQuantizationType

BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=5000.0,
    rms_norm_eps=1e-5, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=True, initializer_range=0.2,
)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
               "rope_theta": 5000.0}
# name -> (transformers config class, overrides): one variant per difference under test.
VARIANTS = {
    "llama": ("LlamaConfig", {}),
    "llama3": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE}),
    "mistral": ("MistralConfig", {"sliding_window": 6}),
    "qwen2": ("Qwen2Config", {}),
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 5,
                                     "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),  # wider than hidden / heads
}
GGUF_ARCH = {"LlamaConfig": "llama", "MistralConfig": "llama", "Qwen2Config": "qwen2",
             "Qwen3Config": "qwen3"}


def make_model(variant: str, seed: int = 0, **overrides):
    """A random model in fp32 with peaked logits; norms and biases jittered so a missing or
    wrong one shows in the logits."""
    import transformers

    config_class, variant_overrides = VARIANTS[variant]
    config = getattr(transformers, config_class)(**{**BASE, **variant_overrides, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * 0.2)
    return model


def llama3_rope_factors(config) -> np.ndarray:
    """What convert_hf_to_gguf.py stores as rope_freqs for "llama3" rope (its own loop)."""
    rope = config.rope_parameters
    dim = config.head_dim
    base = rope["rope_theta"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


# Where each type keeps its fp16 scales in a block, and the value that keeps weights small:
# (block bytes, [(byte offset, fp16 value)]). dmin = d * mid-code keeps the mean near zero.
_K_BLOCKS = {
    Q.Q4_K: (144, [(0, 4e-4), (2, 4e-4 * 7.5)]),
    Q.Q5_K: (176, [(0, 2e-4), (2, 2e-4 * 15.5)]),
    Q.Q6_K: (210, [(208, 5e-5)]),
}


def random_quantized(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks of a K-quant type: [rows, cols / 256 * block bytes] uint8."""
    block_bytes, halves = _K_BLOCKS[qtype]
    raw = rng.integers(0, 256, (rows * cols // 256, block_bytes), dtype=np.uint8)
    for offset, value in halves:
        raw[:, offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def quantize_like_file(model, qtype_of, seed: int = 0) -> dict[str, np.ndarray]:
    """Replace each 2-D weight of `model` with the values a file of the given types would hold
    (qtype_of(hf_name, array) -> a type or None for F32); returns hf name -> raw blocks."""
    rng = np.random.default_rng(seed)
    raws = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            qtype = qtype_of(name, param) if param.ndim == 2 else None
            if qtype is None:
                continue
            if qtype in _K_BLOCKS:
                raw = random_quantized(*param.shape, qtype, rng)
            else:
                raw = gguf.quants.quantize(param.numpy(), qtype)
            param.copy_(torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype),
                                                    dtype=np.float32)))
            raws[name] = (raw, qtype)
    return raws


def write_gguf(model, path: Path, raws: dict | None = None, *, rope_freqs: bool = True,
               sliding_window: bool = True) -> Path:
    """`model` as a GGUF file; `raws` (from quantize_like_file) gives quantized tensors."""
    cfg = model.config
    arch = GGUF_ARCH[type(cfg).__name__]
    raws = raws or {}
    writer = gguf.GGUFWriter(str(path), arch)
    add_gguf_hparams(writer, cfg)
    if sliding_window and getattr(cfg, "sliding_window", None) and arch == "llama":
        writer.add_sliding_window(cfg.sliding_window)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if rope_freqs and cfg.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array, qtype = raws.get(name, (tensor.float().numpy(), None))
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            array = permute_qk_like_llama_cpp(array, heads)  # raw rows are whole blocks too
        if qtype is None:
            writer.add_tensor(gguf_name(name), array)
        else:
            writer.add_tensor(gguf_name(name), array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, cut after the first eos as the engine stops."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    eos = model.config.eos_token_id
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run on one thread: on a shared CPU two threads fight (measured 3.3 s vs
    0.05 s for the same greedy runs under load), and a hidden size of 64 has nothing to split.
    Imported by the test modules that use these models; restored after each module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
