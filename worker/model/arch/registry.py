"""The architectures the worker runs, each described by one small file beside this one.

An architecture is plain Llama plus differences: which config fields its files set (parsed
here into LlamaConfig fields) and how llama.cpp stored its Q/K rows. The decoder itself
(worker.model.llama) reads the fields; weights it may carry (Q/K/V biases, Q/K norms) are
taken when the file has them, and a file tensor the model would not use is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zeroserve.worker.model.llama_config import UnsupportedModelError

# get(key, default) reads "{arch}.key" from a GGUF file's metadata.
GGUFGetter = Callable[[str, Any], Any]


def _no_fields(_source) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Architecture:
    name: str
    hf_model_types: tuple[str, ...]  # config.json "model_type"
    gguf_archs: tuple[str, ...]  # GGUF "general.architecture"
    # config.json -> the LlamaConfig fields this architecture sets beyond plain Llama's.
    hf_fields: Callable[[dict], dict[str, Any]] = field(default=_no_fields)
    # GGUF metadata -> the same, for a GGUF file.
    gguf_fields: Callable[[GGUFGetter], dict[str, Any]] = field(default=_no_fields)
    # llama.cpp's converter permutes Q/K rows into interleaved RoPE pairs for Llama only;
    # the NeoX-RoPE architectures (Qwen) keep Hugging Face's rotate-half layout.
    gguf_permuted_qk: bool = False


_ARCHITECTURES: list[Architecture] = []


def register(arch: Architecture) -> Architecture:
    _ARCHITECTURES.append(arch)
    return arch


def supported_names() -> str:
    return ", ".join(a.name for a in _ARCHITECTURES)


def for_hf_model_type(model_type: Any) -> Architecture:
    for arch in _ARCHITECTURES:
        if model_type in arch.hf_model_types:
            return arch
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not supported (supported: {supported_names()})")


def for_gguf_arch(name: Any) -> Architecture:
    for arch in _ARCHITECTURES:
        if name in arch.gguf_archs:
            return arch
    raise UnsupportedModelError(
        f"GGUF architecture {name!r} is not supported (supported: {supported_names()})")


def hf_sliding_window(hf: dict) -> dict[str, Any]:
    """Qwen-style windows: only with use_sliding_window, in the layers that layer_types marks
    "sliding_attention" (or, in older configs, from max_window_layers on)."""
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window") or window is None:
        return {}
    num_layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:
        first = int(hf.get("max_window_layers", num_layers))
        layers = tuple(range(first, num_layers))
    else:
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return {"sliding_window": int(window), "sliding_window_layers": layers}


def gguf_sliding_window(get: GGUFGetter) -> dict[str, Any]:
    window = get("attention.sliding_window", None)
    return {} if not window else {"sliding_window": int(window)}
