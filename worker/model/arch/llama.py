"""Llama 1-3.x (and the SmolLM family): the plain decoder. Llama 3.x rope scaling is read
generically (worker.model.hf_weights, worker.model.rope)."""

from __future__ import annotations

from typing import Any

from zeroserve.worker.model.arch.registry import Architecture, gguf_sliding_window, register
from zeroserve.worker.model.llama_config import UnsupportedModelError


def _hf_fields(hf: dict) -> dict[str, Any]:
    if hf.get("mlp_bias"):
        raise UnsupportedModelError("Llama with mlp_bias is not supported")
    # attention_bias puts biases on q/k/v/o; the loader takes them when the weights have them.
    return {}


LLAMA = register(Architecture(
    name="llama", hf_model_types=("llama",), gguf_archs=("llama",),
    hf_fields=_hf_fields, gguf_fields=gguf_sliding_window, gguf_permuted_qk=True,
))
