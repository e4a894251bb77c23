"""Qwen2 / Qwen2.5: Llama with biases on the q/k/v projections (always present in the
weights) and an optional per-layer sliding window."""

from __future__ import annotations

from zeroserve.worker.model.arch.registry import (
    Architecture,
    gguf_sliding_window,
    hf_sliding_window,
    register,
)

QWEN2 = register(Architecture(
    name="qwen2", hf_model_types=("qwen2",), gguf_archs=("qwen2",),
    hf_fields=hf_sliding_window, gguf_fields=gguf_sliding_window,
))
