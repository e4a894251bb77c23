"""Engine configuration: one frozen dataclass, validated on creation."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BatchingMode(enum.Enum):
    CONTINUOUS = "continuous"  # the product: sequences join and leave every step
    STATIC = "static"  # benchmark baseline: fixed padded batch, runs until the slowest ends
    DYNAMIC = "dynamic"  # benchmark baseline: gather for batch_wait_ms, then run to completion


ATTENTION_BACKENDS = ("auto", "native", "torch")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"  # "default" (embedded SmolLM2), a .gguf path, or a HF directory
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    dtype: str = "auto"  # "auto", "float32", "bfloat16", "float16"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's own context length
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size wins over kv_cache_memory
    kv_cache_memory: int | None = None  # bytes; None: derived from free memory after weights
    enable_prefix_caching: bool = True
    batching_mode: BatchingMode = BatchingMode.CONTINUOUS
    batch_wait_ms: float = 50.0  # dynamic mode only
    num_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default
    # Decode attention: "native" (the compiled CPU kernel, worker/csrc), "torch", or "auto"
    # (native for bf16 on the CPU where it builds, torch otherwise).
    attention_backend: str = "auto"
    seed: int = 0
    # Prepared weights are written once to a cache file and memory-mapped on later starts
    # (worker/weight_cache.py). None: $ZEROSERVE_CACHE_DIR/weights or ~/.cache/zeroserve/weights.
    weight_cache: bool = True
    weight_cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}")
        if self.batch_wait_ms < 0:
            raise ValueError("batch_wait_ms must be >= 0")
