"""Rotary embedding frequencies, as Hugging Face computes them for each rope type.

"llama3" (Llama 3.1+) leaves high frequencies alone, divides low ones by `factor` and blends
in between. A GGUF file carries the result as per-frequency divisors instead (llama.cpp's
`rope_freqs` tensor, theta_i / f_i), which covers any rope variant expressed that way.
"""

from __future__ import annotations

import math

import torch

from zeroserve.worker.model.llama_config import LlamaConfig, UnsupportedModelError


def default_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """[head_dim / 2] fp32, bit-identical to transformers' default rope."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (config.rope_theta**exponents)


def llama3_inv_freq(config: LlamaConfig) -> torch.Tensor:
    inv_freq = default_inv_freq(config)
    factor = config.rope_scaling_factor
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    old_len = config.rope_original_max_position
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def inv_freq(config: LlamaConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """The model's inverse frequencies [head_dim / 2]; `freq_factors` from a GGUF file."""
    if freq_factors is not None:
        if freq_factors.shape != (config.head_dim // 2,):
            raise UnsupportedModelError(f"rope_freqs has shape {tuple(freq_factors.shape)}, "
                             f"expected ({config.head_dim // 2},)")
        return default_inv_freq(config) / freq_factors.float()
    if config.rope_type == "llama3":
        return llama3_inv_freq(config)
    return default_inv_freq(config)  # linear scaling divides positions (worker.model.llama)
