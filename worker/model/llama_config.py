"""The architecture hyper-parameters of a Llama-family model, whatever file they came from.

Llama, Mistral, Qwen2 and Qwen3 share one decoder (RMSNorm, RoPE, GQA attention, SwiGLU);
their differences are fields here, set by their file in worker/model/arch/. Every field is a
plain value, so the weight cache can store the config as a dict.
"""

from __future__ import annotations

from dataclasses import dataclass

ROPE_TYPES = ("default", "linear", "llama3")


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
    architecture: str = "llama"  # the worker.model.arch entry that read it
    # "default", "linear" or "llama3" (HF rope_scaling; a GGUF carries llama3's per-frequency
    # factors as its rope_freqs tensor instead, see worker.model.rope).
    rope_type: str = "default"
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_position: int = 8192  # llama3 only
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each q and k head, before RoPE
    # Attention sees only the last `sliding_window` keys (key k for query q iff q - k <
    # window), in the layers listed (None: every layer).
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"{self.num_heads} attention heads do not split into {self.num_kv_heads} KV heads"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError("rotary embeddings need an even head_dim")
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"rope scaling {self.rope_type!r} is not supported")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UnsupportedModelError(f"sliding_window {self.sliding_window} is not positive")
        if self.sliding_window_layers is not None:  # a list after a round trip through a cache
            object.__setattr__(self, "sliding_window_layers", tuple(self.sliding_window_layers))

    def window_of(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends through; None for full attention."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is None or layer in self.sliding_window_layers:
            return self.sliding_window
        return None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads
