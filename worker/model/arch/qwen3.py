"""Qwen3: Llama with an RMSNorm over each q and k head before RoPE, an explicit head_dim
(wider than hidden / heads), and optional q/k/v biases (attention_bias)."""

from __future__ import annotations

from typing import Any

from zeroserve.worker.model.arch.registry import (
    Architecture,
    GGUFGetter,
    gguf_sliding_window,
    hf_sliding_window,
    register,
)


def _hf_fields(hf: dict) -> dict[str, Any]:
    return {"qk_norm": True, **hf_sliding_window(hf)}


def _gguf_fields(get: GGUFGetter) -> dict[str, Any]:
    return {"qk_norm": True, **gguf_sliding_window(get)}


QWEN3 = register(Architecture(
    name="qwen3", hf_model_types=("qwen3",), gguf_archs=("qwen3",),
    hf_fields=_hf_fields, gguf_fields=_gguf_fields,
))
