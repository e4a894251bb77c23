"""Mistral: Llama with a sliding attention window on every layer where config.json sets one
(7B v0.1: 4096; later versions: null). llama.cpp writes Mistral GGUFs as "llama"."""

from __future__ import annotations

from typing import Any

from zeroserve.worker.model.arch.registry import Architecture, register


def _hf_fields(hf: dict) -> dict[str, Any]:
    window = hf.get("sliding_window")
    return {} if window is None else {"sliding_window": int(window)}


MISTRAL = register(Architecture(
    name="mistral", hf_model_types=("mistral",), gguf_archs=(), hf_fields=_hf_fields,
))
