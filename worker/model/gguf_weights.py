"""Reading a Llama-family GGUF file: hyper-parameters, special tokens and dequantized weights.

Weights come out under Hugging Face names and in Hugging Face layout, so the model has one
layout to serve. llama.cpp's converter permutes the rows of Q and K so that each head's
rotary pairs are adjacent ((x0, x1), (x2, x3), ...: "interleaved" RoPE); the HF layout pairs
dimension i with i + head_dim/2 ("rotate half"). `unpermute_qk` undoes the converter.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch

from zeroserve.worker.model.arch import Architecture, for_gguf_arch
from zeroserve.worker.model.kquant import int4_blocks
from zeroserve.worker.model.llama_config import LlamaConfig, UnsupportedModelError
from zeroserve.worker.model.quant import Int4Blocks, Int8Blocks, int8_blocks_from_gguf
from zeroserve.worker.model.weights import ROPE_FREQS, ModelWeights

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    # Llama 3.x rope scaling: per-frequency divisors (worker.model.rope).
    "rope_freqs.weight": ROPE_FREQS,
}


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp convert_hf_to_gguf's `permute` for a Q or K projection
    `[num_heads * head_dim, hidden]`: rows (h, i, pair) go back to (h, pair, i)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def hf_tensor_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None if unknown."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS and parts[3] in (
            "weight", "bias"):
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    return None


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader: gguf.GGUFReader) -> LlamaConfig:
    name = _field(reader, "general.architecture")
    arch = for_gguf_arch(name)

    def get(key: str, default=None):
        return _field(reader, f"{name}.{key}", default)

    tensor_names = {t.name for t in reader.tensors}
    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    head_dim = int(get("attention.key_length", hidden // num_heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise UnsupportedModelError(f"rope scaling {scaling!r} is not supported")
    return LlamaConfig(
        vocab_size=int(embed.shape[1]),  # GGUF shapes list the fastest-varying dim first
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=int(get("context_length", 2048)),
        rope_type="linear" if scaling == "linear" else "default",
        rope_scaling_factor=float(get("rope.scaling.factor", 1.0))
        if scaling == "linear"
        else 1.0,
        architecture=arch.name,
        **arch.gguf_fields(get),
    )


def _read_tensors(reader: gguf.GGUFReader, config: LlamaConfig, arch: Architecture
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Int4Blocks], dict[str, Int8Blocks]]:
    tensors: dict[str, torch.Tensor] = {}
    int4: dict[str, Int4Blocks] = {}
    int8: dict[str, Int8Blocks] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:  # never drop a tensor we do not know: the text would be wrong
            raise UnsupportedModelError(
                f"tensor {tensor.name} is not supported for GGUF architecture {arch.name!r}")
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise UnsupportedModelError(
                f"tensor {tensor.name} has type {tensor.tensor_type.name}, which gguf cannot dequantize"
            ) from exc
        array = np.asarray(array, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))
        blocks = int4_blocks(tensor.data, tensor.tensor_type)
        blocks8 = int8_blocks_from_gguf(tensor.data, tensor.tensor_type)
        module = name.split(".")[-2] if "." in name else name
        heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(module)
        if heads is not None and arch.gguf_permuted_qk:
            array = unpermute_qk(array, heads)
            if blocks is not None:
                blocks = blocks.map_rows(lambda rows, h=heads: unpermute_qk(rows, h))
            if blocks8 is not None:
                blocks8 = blocks8.map_rows(lambda rows, h=heads: unpermute_qk(rows, h))
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = array.copy()  # F32 tensors come back as views of the read-only mmap
        tensors[name] = torch.from_numpy(array)
        if blocks is not None:
            int4[name] = blocks
        if blocks8 is not None:
            int8[name] = blocks8
    return tensors, int4, int8


def _special_ids(reader: gguf.GGUFReader) -> tuple[tuple[int, ...], int | None]:
    eos = []
    # eot/eom are what chat models emit at the end of a turn; serving stops on them too.
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos:
            eos.append(int(value))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return tuple(eos), None if bos is None else int(bos)


def load_gguf(path: Path) -> ModelWeights:
    reader = gguf.GGUFReader(str(path))
    config = read_config(reader)
    eos_ids, bos_id = _special_ids(reader)
    tensors, int4, int8 = _read_tensors(reader, config, for_gguf_arch(_field(reader, "general.architecture")))
    types = Counter(t.tensor_type.name for t in reader.tensors)
    return ModelWeights(config=config, tensors=tensors, eos_token_ids=eos_ids,
                        bos_token_id=bos_id, int4=int4, int8=int8, tensor_types=dict(types))
