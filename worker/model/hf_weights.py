"""Reading a Hugging Face model directory: config.json, generation_config.json, *.safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from worker.model.llama_config import LlamaConfig, UnsupportedModelError
from worker.model.weights import ModelWeights

SUPPORTED_MODEL_TYPES = ("llama",)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _rope_settings(hf: dict) -> tuple[float, float]:
    """(rope_theta, linear scaling factor). transformers >= 5 nests them in rope_parameters."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear"):
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    factor = float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0
    return theta, factor


def read_config(hf: dict) -> LlamaConfig:
    if hf.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {hf.get('model_type')!r} is not supported (llama only)"
        )
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    theta, factor = _rope_settings(hf)
    return LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        rope_theta=theta,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        rope_scaling_factor=factor,
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
    return ModelWeights(
        config=config,
        tensors=_read_tensors(directory),
        eos_token_ids=eos_ids,
        bos_token_id=bos_id,
    )
