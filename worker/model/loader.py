"""Loading a model once per worker process: GGUF file or Hugging Face directory -> LlamaModel."""

from __future__ import annotations

from pathlib import Path

import torch

from common.model_files import model_display_name, resolve_model
from worker.device import dtype_name
from worker.model.gguf_weights import load_gguf
from worker.model.hf_weights import load_hf_directory
from worker.model.info import ModelInfo
from worker.model.llama import LlamaModel
from worker.model.llama_config import UnsupportedModelError
from worker.model.weights import ModelWeights


def load_weights(path: Path) -> ModelWeights:
    """Read a .gguf file or a HF directory (config.json + *.safetensors) into HF-named weights."""
    if path.is_dir():
        return load_hf_directory(path)
    if path.suffix == ".gguf":
        return load_gguf(path)
    raise UnsupportedModelError(f"{path} is neither a .gguf file nor a Hugging Face directory")


def load_model(model: str, device: torch.device, dtype: torch.dtype,
               max_model_len: int | None = None) -> tuple[LlamaModel, ModelInfo]:
    """`model` as EngineConfig.model ("default", a .gguf path or a HF directory).

    The context in effect is the smaller of max_model_len and the model's own.
    """
    path = resolve_model(model)
    weights = load_weights(path)
    config = weights.config
    context_len = config.max_position_embeddings
    if max_model_len is not None:
        context_len = min(context_len, max_model_len)
    info = ModelInfo(
        name=model_display_name(model),
        path=str(path),
        max_model_len=context_len,
        vocab_size=config.vocab_size,
        eos_token_ids=weights.eos_token_ids,
        bos_token_id=weights.bos_token_id,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        device=str(device),
        dtype=dtype_name(dtype),
    )
    return LlamaModel(weights, context_len, device, dtype), info
