"""What a loader hands the model: hyper-parameters, special tokens and named weights."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zeroserve.worker.model.llama_config import LlamaConfig, UnsupportedModelError
from zeroserve.worker.model.quant import Int4Blocks, Int8Blocks

# A GGUF file's Llama 3 rope factors (llama.cpp's rope_freqs tensor) under this name.
ROPE_FREQS = "rope_freqs"


@dataclass
class ModelWeights:
    config: LlamaConfig
    # Hugging Face names ("model.layers.0.self_attn.q_proj.weight") in HF layout, on the CPU.
    tensors: dict[str, torch.Tensor]
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    # The original 4-bit blocks of GGUF Q4_0/Q4_1 tensors (same names, HF layout), for the
    # small-batch int4 kernels; `tensors` holds their dequantized values as well.
    int4: dict[str, Int4Blocks] = field(default_factory=dict)
    # Likewise the 8-bit blocks of Q8_0 tensors, for the native fp32 block kernels.
    int8: dict[str, Int8Blocks] = field(default_factory=dict)
    # How the file stored its tensors: type name ("Q4_K", "F32", "bfloat16") -> count.
    tensor_types: dict[str, int] = field(default_factory=dict)

    def take(self, name: str) -> torch.Tensor:
        """Remove and return one tensor, so the loader's copy is freed as the model is built."""
        try:
            return self.tensors.pop(name)
        except KeyError:
            raise UnsupportedModelError(
                f"the {self.config.architecture} model file has no tensor {name}") from None


@dataclass
class PreparedWeights:
    """The tensors the model computes with, on the CPU: projections fused (Q/K/V, gate/up)
    and in the compute dtype, plus their low-bit copies where the model uses them. Names
    are the model's own (worker.model.prepare); the weight cache stores exactly this."""

    config: LlamaConfig
    tensors: dict[str, torch.Tensor]
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def memory_summary(self) -> str:
        """'540.2 MiB (dense 480.0, int4 52.1, int8 8.1)': what the weights take in memory."""
        kinds = {"dense": 0, "int4": 0, "int8": 0}
        for name, tensor in self.tensors.items():
            kind = ("int4" if ".int4." in name or ".q4." in name
                    else "int8" if ".int8." in name or ".q8." in name else "dense")
            kinds[kind] += tensor.nbytes
        mib = 1 << 20
        parts = ", ".join(f"{k} {v / mib:.1f}" for k, v in kinds.items() if v)
        return f"{sum(kinds.values()) / mib:.1f} MiB ({parts})"
