"""What the rest of the system needs to know about a loaded model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the id clients use (see common.model_files.model_display_name)
    path: str
    max_model_len: int  # the context length in effect (config cap or the model's own)
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    num_layers: int
    num_kv_heads: int
    head_dim: int
    device: str  # "cpu", "cuda:0", ...
    dtype: str  # "float32", "bfloat16", ...
