"""Reading a Hugging Face model directory: config.json, generation_config.json, *.safetensors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open

from zeroserve.worker.model.arch import for_hf_model_type
from zeroserve.worker.model.llama_config import ROPE_TYPES, LlamaConfig, UnsupportedModelError
from zeroserve.worker.model.weights import ModelWeights


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}

def _rope_settings(hf: dict) -> dict:
    """rope_theta and scaling fields. transformers >= 5 nests them in rope_parameters."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    out = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
           "rope_type": kind}
    if kind == "linear":
        out["rope_scaling_factor"] = float(scaling["factor"])
    elif kind == "llama3":
        out.update(
            rope_scaling_factor=float(scaling["factor"]),
            rope_low_freq_factor=float(scaling["low_freq_factor"]),
            rope_high_freq_factor=float(scaling["high_freq_factor"]),
            rope_original_max_position=int(scaling["original_max_position_embeddings"]),
        )
    return out


def read_config(hf: dict) -> LlamaConfig:
    arch = for_hf_model_type(hf.get("model_type"))
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf.get('hidden_act')!r} is not supported (silu)")
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    return LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        architecture=arch.name,
        **_rope_settings(hf),
        **arch.hf_fields(hf),
    )


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _special_ids(hf: dict, generation: dict) -> tuple[tuple[int, ...], int | None]:
    # generation_config.json often lists more end-of-turn ids than config.json: serve on all.
    eos: list[int] = []
    for token_id in _as_ids(hf.get("eos_token_id")) + _as_ids(generation.get("eos_token_id")):
        if token_id not in eos:
            eos.append(token_id)
    bos = generation.get("bos_token_id", hf.get("bos_token_id"))
    return tuple(eos), None if bos is None else int(bos)


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{directory} has no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.startswith("model.") or name == "lm_head.weight":
                    tensors[name] = handle.get_tensor(name)
    return tensors


def load_hf_directory(directory: Path) -> ModelWeights:
    hf = _read_json(directory / "config.json")
    generation = _read_json(directory / "generation_config.json")
    config = read_config(hf)
    eos_ids, bos_id = _special_ids(hf, generation)
    tensors = _read_tensors(directory)
    types = Counter(str(t.dtype).removeprefix("torch.") for t in tensors.values())
    return ModelWeights(config=config, tensors=tensors, eos_token_ids=eos_ids,
                        bos_token_id=bos_id, tensor_types=dict(types))
