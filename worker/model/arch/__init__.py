"""Supported architectures: one file each (llama, mistral, qwen2, qwen3), registered on import.

To add one, write `worker/model/arch/NAME.py` registering an `Architecture` (its config
fields and GGUF naming) and import it below.
"""

from zeroserve.worker.model.arch import llama, mistral, qwen2, qwen3  # noqa: F401 - registration
from zeroserve.worker.model.arch.registry import (
    Architecture,
    for_gguf_arch,
    for_hf_model_type,
    supported_names,
)

__all__ = ["Architecture", "for_gguf_arch", "for_hf_model_type", "supported_names"]
