"""Preparing weights for serving: what a loader read -> the tensors the model computes with.

Q/K/V and gate/up are fused into one matrix each, everything is converted to the compute
dtype, and on the CPU the small-batch copies are made. In bfloat16 for torch's kernels: int4
from GGUF Q4 blocks (the dense copy then holds the very values the int4 kernel uses) and int8
for the lm_head. In float32 for the native block kernels (worker/csrc/lowbit_matmul.cpp): the
file's own Q4 and Q8_0 blocks, the lm_head's included; the dense copy stays the file's values,
in fp32, or in bf16 for the layers' projections (BLOCKS_BF16: `--dtype auto` on a CPU with
native bf16, where prompt rows then run at its bf16 rate while decode rows, activations and
the KV cache stay fp32). With int8 activations in every row (INT8_ROWS, the `--dtype auto`
default) a projection with a block copy has no dense copy at all.
This is the slow part of a start after parsing the file; the result is plain CPU tensors, so
the weight cache (worker/weight_cache.py) can store it once and map it on later starts.

Names: `embed`, `norm`, `lm_head` (absent when tied to `embed`), `lm_head.int8.*` (or
`.q4.*`/`.q8.*`), and per layer `layers.{i}.{input_norm,post_norm,qkv,o_proj,gate_up,down}` with
`.int4.*` copies (or `.q4.blocks` / `.q8.blocks`);
where the architecture has them, `layers.{i}.{qkv_bias,o_bias,q_norm,k_norm}` and the GGUF
rope factors `rope_freqs` (fp32). A tensor of the file that none of these uses is refused:
a model that ignored part of its weights would serve wrong text.
"""

from __future__ import annotations

import torch

from zeroserve.worker.model.llama_config import UnsupportedModelError
from zeroserve.worker.model.quant import (
    BlockQ4,
    BlockQ8,
    Int4Blocks,
    Int8Blocks,
    PackedInt4,
    PackedInt8,
    block_kernels_available,
    int4_kernels_available,
)
from zeroserve.worker.model.weights import ROPE_FREQS, ModelWeights, PreparedWeights

# Fused projection -> the Hugging Face projections it concatenates, row-wise in this order.
LAYER_LINEARS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
LAYER_NORMS = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}
QK_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
# Saved by some checkpoints and recomputed here: safe to leave.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


INT4 = "int4"  # torch's int4/int8 kernels, bf16 on the CPU
BLOCKS = "blocks"  # the native kernels on the file's Q4/Q8_0 blocks, fp32 on the CPU
# BLOCKS for decode rows, and the projections' dense copies (prompt rows) in bf16: fp32
# activations and KV, the prompt's big products at the CPU's native bf16 rate.
BLOCKS_BF16 = "blocks+bf16"
# Appended to BLOCKS or BLOCKS_BF16 where every row of the layers' projections takes the
# block copy's int8-activation kernel (`--int8-activations`, the `--dtype auto` default:
# Linear.int8_all_rows): a projection with a block copy then keeps no dense copy, which
# nothing would read (SmolLM2-135M: 203 MiB of bf16, 406 MiB of fp32). A projection without
# one (its parts mix Q4 and Q8_0) keeps its dense copy as the base packing makes it, and so
# does the lm_head, whose prompt rows keep fp32 activations.
INT8_ROWS = "+int8"


def packing(device: torch.device, dtype: torch.dtype,
            prompt_dtype: torch.dtype | None = None, int8_activations: bool = False) -> str:
    """Which low-bit copies decode rows get: INT4, BLOCKS (BLOCKS_BF16 where prompt rows
    compute in bf16 beside fp32: `prompt_dtype`; either + INT8_ROWS where every row of the
    projections takes int8 activations: `int8_activations`), or "" (none: the dense weights
    only, as on a GPU, or in fp32 where the native kernels cannot be built)."""
    if device.type != "cpu":
        return ""
    if dtype == torch.bfloat16:
        return INT4 if int4_kernels_available() else ""
    if dtype == torch.float32 and block_kernels_available():
        base = BLOCKS_BF16 if prompt_dtype == torch.bfloat16 else BLOCKS
        return base + INT8_ROWS if int8_activations else base
    return ""


def prepare_weights(weights: ModelWeights, dtype: torch.dtype, pack: str) -> PreparedWeights:
    """Consumes `weights` (each tensor is taken as it is used, so memory stays flat)."""
    config = weights.config
    tensors: dict[str, torch.Tensor] = {}
    int8_rows = pack.endswith(INT8_ROWS)
    pack = pack.removesuffix(INT8_ROWS)

    def blocks_copy(name: str, hf_names: list[str]) -> bool:
        """`name`'s block copy for the native kernels, where all its parts have blocks of
        one kind (a projection whose parts mix Q4 and Q8_0 keeps only the dense copy).
        -> whether it has one."""
        int4 = [weights.int4.pop(n, None) for n in hf_names]
        int8 = [weights.int8.pop(n, None) for n in hf_names]
        if all(b is not None for b in int4):
            tensors[f"{name}.q4.blocks"] = BlockQ4.tensors(Int4Blocks.concat(int4))
        elif all(b is not None for b in int8):
            tensors[f"{name}.q8.blocks"] = BlockQ8.tensors(Int8Blocks.concat(int8))
        else:
            return False
        return True

    def linear(name: str, hf_names: list[str]) -> None:
        if pack in (BLOCKS, BLOCKS_BF16):
            if blocks_copy(name, hf_names) and int8_rows:  # every row takes the copy
                for n in hf_names:
                    weights.take(n)
                return
            dense_dtype = torch.bfloat16 if pack == BLOCKS_BF16 else dtype
            tensors[name] = torch.cat([weights.take(n) for n in hf_names]).to(dense_dtype).contiguous()
            return
        blocks = [weights.int4.pop(n, None) for n in hf_names]
        dense = torch.cat([weights.take(n) for n in hf_names])
        if pack == INT4 and all(b is not None for b in blocks):
            merged = Int4Blocks.concat(blocks)
            packed = PackedInt4.from_blocks(merged, dtype)
            tensors[f"{name}.int4.weight"] = packed.weight
            tensors[f"{name}.int4.scales_and_zeros"] = packed.scales_and_zeros
            dense = merged.dequantize(dtype)  # the very values the int4 kernel uses
        tensors[name] = dense.to(dtype).contiguous()

    tensors["embed"] = weights.take("model.embed_tokens.weight").to(dtype).contiguous()
    for i in range(config.num_layers):
        hf_prefix = f"model.layers.{i}."
        for name, hf_name in LAYER_NORMS.items():
            tensors[f"layers.{i}.{name}"] = weights.take(f"{hf_prefix}{hf_name}.weight").to(dtype)
        for name, hf_names in LAYER_LINEARS.items():
            linear(f"layers.{i}.{name}", [f"{hf_prefix}{n}.weight" for n in hf_names])
        _attention_extras(weights, tensors, i, dtype)
    tensors["norm"] = weights.take("model.norm.weight").to(dtype)
    if pack in (BLOCKS, BLOCKS_BF16):
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights.tensors
        blocks_copy("lm_head", ["model.embed_tokens.weight" if tied else "lm_head.weight"])
    weights.int4.clear()  # blocks no copy uses (the embedding's, when not tied)
    weights.int8.clear()
    lm_head = tensors["embed"]
    if not config.tie_word_embeddings and "lm_head.weight" in weights.tensors:
        lm_head = tensors["lm_head"] = weights.take("lm_head.weight").to(dtype).contiguous()
    if ROPE_FREQS in weights.tensors:
        tensors[ROPE_FREQS] = weights.take(ROPE_FREQS).float()
    if config.tie_word_embeddings:
        weights.tensors.pop("lm_head.weight", None)  # a saved copy of the tied embedding
    _check_all_used(weights)
    if pack == INT4:
        packed8 = PackedInt8.quantize(lm_head, dtype)
        tensors["lm_head.int8.weight"] = packed8.weight
        tensors["lm_head.int8.scales"] = packed8.scales
    return PreparedWeights(config=config, tensors=tensors, eos_token_ids=weights.eos_token_ids,
                           bos_token_id=weights.bos_token_id)


def _attention_extras(weights: ModelWeights, tensors: dict[str, torch.Tensor], i: int,
                      dtype: torch.dtype) -> None:
    """Q/K/V and output biases where the file has them, Q/K norms where the config says."""
    prefix = f"model.layers.{i}.self_attn."
    qkv = [f"{prefix}{p}_proj.bias" for p in "qkv"]
    present = [name in weights.tensors for name in qkv]
    if any(present):
        if not all(present):
            raise UnsupportedModelError(f"layer {i} has biases on only some of q/k/v")
        tensors[f"layers.{i}.qkv_bias"] = torch.cat([weights.take(n) for n in qkv]).to(dtype)
    if f"{prefix}o_proj.bias" in weights.tensors:
        tensors[f"layers.{i}.o_bias"] = weights.take(f"{prefix}o_proj.bias").to(dtype)
    if weights.config.qk_norm:
        for name, hf_name in QK_NORMS.items():
            tensors[f"layers.{i}.{name}"] = weights.take(
                f"model.layers.{i}.{hf_name}.weight").to(dtype)


def _check_all_used(weights: ModelWeights) -> None:
    unused = sorted(n for n in weights.tensors if not n.endswith(_IGNORED_SUFFIXES))
    if unused:
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        raise UnsupportedModelError(
            f"the {weights.config.architecture} model has weights this server does not use "
            f"({', '.join(unused[:5])}{more}); refusing to serve it wrong")
