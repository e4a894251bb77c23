"""The architecture hyper-parameters of a Llama-family model, whatever file they came from."""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedModelError(ValueError):
    """The model file describes something this worker cannot run (architecture, rope, dtype)."""


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    # Linear rope scaling ("linear" in HF, "linear" in GGUF): positions are divided by it.
    rope_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"{self.num_heads} attention heads do not split into {self.num_kv_heads} KV heads"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError("rotary embeddings need an even head_dim")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads
