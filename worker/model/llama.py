"""The Llama-family decoder in plain torch, over a flattened batch of tokens.

Every projection and the MLP run on `[num_tokens, hidden]` with no padding; only attention
(worker.attention) knows where one sequence ends and the next begins. Q/K/V and gate/up are
each one fused weight, so a layer is four matmuls. The layers are plain objects rather than
nn.Modules: nothing here trains, and module call overhead adds up at 30 layers per step.

The architectures of worker/model/arch differ only in what the config and weights carry:
Q/K/V (and output) biases (Qwen2), per-head Q/K RMSNorm (Qwen3), rope scaling (Llama 3) and
a sliding attention window (Mistral); a layer without them runs the plain Llama path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zeroserve.worker.attention import AttentionMetadata, PrefillSpan, causal_mask, paged_attention
from zeroserve.worker.model.batch_invariance import dense_min_rows, dense_tile_rows
from zeroserve.worker.model.linear import Linear
from zeroserve.worker.model.llama_config import LlamaConfig
from zeroserve.worker.model.quant import BlockQ4, BlockQ8, PackedInt4, PackedInt8
from zeroserve.worker.model.rope import inv_freq
from zeroserve.worker.model.row_ops import NativeRowOps, TorchRowOps, row_ops
from zeroserve.worker.model.sliding_window import windowed
from zeroserve.worker.model.weights import ROPE_FREQS, PreparedWeights

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each [num_blocks, block_size, kv_heads, head_dim]


class RotaryEmbedding:
    """cos/sin tables for positions 0 .. max_len-1, in fp32 as Hugging Face computes them."""

    def __init__(self, config: LlamaConfig, max_len: int, device: torch.device,
                 freq_factors: torch.Tensor | None = None):
        positions = torch.arange(max_len, dtype=torch.float32)
        if config.rope_type == "linear":
            positions = positions / config.rope_scaling_factor
        freqs = positions[:, None] * inv_freq(config, freq_factors)[None, :]  # [max_len, d / 2]
        # Full-width tables with the rotate-half sign folded into sin, so that
        # rotary(x) = x * cos + swap_halves(x) * sin: three arithmetic ops per layer.
        self.cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1).to(device)  # [max_len, d]
        self.sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, head_dim] cos and signed sin for these positions, once per step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def load_linear(tensors: dict[str, torch.Tensor], name: str, device: torch.device,
                tile_rows: int | None = None, min_rows: int = 1,
                out_features: int | None = None) -> Linear:
    """A prepared projection (worker.model.prepare) and its low-bit copy if it has one. A
    projection prepared without a dense copy (prepare.INT8_ROWS) is its block copy alone,
    which takes every row; `out_features` is then its size (the copy pads its last panel)."""
    dense = tensors.get(name)
    if dense is None:
        packed = None if out_features is None else low_bit_copy(tensors, name, out_features)
        if packed is None:
            raise KeyError(f"{name}: neither a dense weight nor a block copy")
        return Linear(None, packed, tile_rows, min_rows)
    return Linear(dense.to(device), low_bit_copy(tensors, name, dense.shape[0]), tile_rows,
                  min_rows)


def low_bit_copy(tensors: dict[str, torch.Tensor], name: str, out_features: int
                 ) -> PackedInt4 | PackedInt8 | BlockQ4 | BlockQ8 | None:
    """The copy worker.model.prepare made of `name` (`out_features` outputs) for decode rows,
    if any."""
    if f"{name}.int4.weight" in tensors:
        return PackedInt4(tensors[f"{name}.int4.weight"], tensors[f"{name}.int4.scales_and_zeros"])
    if f"{name}.int8.weight" in tensors:
        return PackedInt8(tensors[f"{name}.int8.weight"], tensors[f"{name}.int8.scales"])
    if f"{name}.q4.blocks" in tensors:
        return BlockQ4(tensors[f"{name}.q4.blocks"], out_features)
    if f"{name}.q8.blocks" in tensors:
        return BlockQ8(tensors[f"{name}.q8.blocks"], out_features)
    return None


def _optional(tensors: dict[str, torch.Tensor], name: str,
              device: torch.device) -> torch.Tensor | None:
    return tensors[name].to(device) if name in tensors else None


class LlamaLayer:
    def __init__(self, config: LlamaConfig, tensors: dict[str, torch.Tensor], index: int,
                 device: torch.device, tile_rows: int | None = None,
                 ops: TorchRowOps | None = None, min_rows: int = 1):
        prefix = f"layers.{index}."
        self.config = config
        self.input_norm = tensors[prefix + "input_norm"].to(device)
        sizes = {"qkv": config.q_size + 2 * config.kv_size, "o_proj": config.hidden_size,
                 "gate_up": 2 * config.intermediate_size, "down": config.hidden_size}
        self.qkv, self.o_proj, self.gate_up, self.down = (
            load_linear(tensors, prefix + name, device, tile_rows, min_rows, size)
            for name, size in sizes.items())
        self.post_norm = tensors[prefix + "post_norm"].to(device)
        self.qkv_bias = _optional(tensors, prefix + "qkv_bias", device)  # [q_size + 2 kv_size]
        self.o_bias = _optional(tensors, prefix + "o_bias", device)
        self.q_norm = _optional(tensors, prefix + "q_norm", device)  # [head_dim]
        self.k_norm = _optional(tensors, prefix + "k_norm", device)
        self.window = config.window_of(index)
        self.ops = ops or TorchRowOps()  # RMSNorm, rotary, SwiGLU (worker.model.row_ops)
        # The native kernels, where a step of decode rows only can call them directly
        # (decode_native); None where forward() must choose per row or op.
        self.native = None
        linears = (self.qkv, self.o_proj, self.gate_up, self.down)
        if (isinstance(self.ops, NativeRowOps) and self.window is None
                and all(isinstance(lin.packed, BlockQ4 | BlockQ8) for lin in linears)
                and all(t is None for t in (self.qkv_bias, self.o_bias, self.q_norm))):
            self.native = self.ops.module

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache | None, meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.config
        ops = self.ops
        n = x.shape[0]
        h = ops.rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        # Decode rows and early prompt positions take the low-bit kernels, other prompt rows
        # the dense weights (Linear).
        qkv = self.qkv(h, meta.low_bit, meta.num_decode)  # [num_tokens, q_size + 2 * kv_size]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        qk = qkv[:, : cfg.q_size + cfg.kv_size].view(n, -1, cfg.head_dim)
        if self.q_norm is not None:
            qk = torch.cat([
                F.rms_norm(qk[:, : cfg.num_heads], (cfg.head_dim,), self.q_norm, cfg.rms_norm_eps),
                F.rms_norm(qk[:, cfg.num_heads :], (cfg.head_dim,), self.k_norm, cfg.rms_norm_eps),
            ], dim=1)
        # Rotate q and k in one go: [num_tokens, heads + kv_heads, head_dim]
        qk = ops.rotary(qk, cos, sin)
        q = qk[:, : cfg.num_heads]
        k = qk[:, cfg.num_heads :]
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(n, cfg.num_kv_heads, cfg.head_dim)
        k_cache, v_cache = kv_cache if kv_cache is not None else (None, None)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta, cfg.head_dim**-0.5)
        out = self.o_proj(attn, meta.low_bit, meta.num_decode)
        x, h = ops.add_rms_norm(x, out if self.o_bias is None else out + self.o_bias,
                                self.post_norm, cfg.rms_norm_eps)
        act = ops.silu_mul(self.gate_up(h, meta.low_bit, meta.num_decode))  # [num_tokens, intermediate]
        return x + self.down(act, meta.low_bit, meta.num_decode)

    def decode_native(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """forward() for a step whose rows are all decodes, where `self.native` is set: the
        very kernels forward() picks for such rows (block copies, native row ops, the paged
        decode kernel), in the same order, called directly. At one row a step is ~300 kernel
        calls of a few microseconds each, and forward()'s choices cost about a tenth of it."""
        cfg = self.config
        native = self.native
        n = x.shape[0]
        qk_size = cfg.q_size + cfg.kv_size
        h = native.rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        qkv = self.qkv.packed.decode_mm(h)
        qk = native.rotary(qkv[:, :qk_size].view(n, -1, cfg.head_dim), cos, sin)
        k_cache, v_cache = kv_cache
        native.write_kv(k_cache, v_cache, qk[:, cfg.num_heads :],
                        qkv[:, qk_size:].view(n, cfg.num_kv_heads, cfg.head_dim),
                        meta.slot_mapping)
        paged = meta.paged_decode
        attn = paged.kernel(qk[:, : cfg.num_heads], k_cache, v_cache, paged.block_tables,
                            paged.context_lens, cfg.head_dim**-0.5)
        x, h = native.add_rms_norm(x, self.o_proj.packed.decode_mm(attn), self.post_norm,
                                   cfg.rms_norm_eps)
        return x + self.down.packed.decode_mm(native.silu_mul(self.gate_up.packed.decode_mm(h)))


@dataclass(frozen=True)
class FusedLayers:
    """worker/csrc/decode_layers.cpp's arguments that do not change from step to step."""

    module: object  # the native kernels' module
    attention: object  # its decode attention: the step's paged kernel must be this one
    weights: list[torch.Tensor]  # per layer: input_norm, qkv, o_proj, post_norm, gate_up, down
    bits: list[int]  # per layer's four products: 4 (BlockQ4) or 8 (BlockQ8)
    out_features: list[int]
    int8_activations: bool = False  # the products quantize x to int8 (BlockQ4.decode_mm)


class LlamaModel:
    def __init__(self, prepared: PreparedWeights, max_len: int, device: torch.device,
                 dtype: torch.dtype, batch_invariant: bool = True):
        """`prepared` holds CPU tensors already in `dtype`; on the CPU they are used in place
        (memory-mapped from the weight cache, shared by every worker that maps the file).
        `batch_invariant`: dense rows tiled where this CPU's dense kernel is not row-independent
        (EngineConfig.batch_invariant). Kernels are chosen per row in every mode (Linear)."""
        config = prepared.config
        tensors = prepared.tensors
        self.config = config
        self.device = device
        self.dtype = dtype
        self.embed = tensors["embed"].to(device)
        lm_head = tensors["lm_head"].to(device) if "lm_head" in tensors else self.embed
        # The projections' dense copies are in `dtype`, or bf16 beside fp32 activations
        # (prepare.BLOCKS_BF16); the lm_head's always in `dtype`.
        # (None of them where every row takes the block copies: prepare.INT8_ROWS.)
        layer_dense = [t for name, t in tensors.items()
                       if name.endswith((".qkv", ".o_proj", ".gate_up", ".down"))]
        layer_dtype = layer_dense[0].dtype if layer_dense else dtype
        layer_inputs = {t.shape[1] for t in layer_dense}
        # Where the dense kernel is not row-independent (a CPU without native bf16), prefill
        # rows run in fixed tiles, so no row's result depends on its batch.
        # Small dense calls padded where this machine computes them another way, in every
        # mode: a prompt's last row alone (after a prefix-cache hit) comes out as within the
        # whole prompt, so the same request gets the same tokens.
        def dense_rules(dense_dtype: torch.dtype, inputs: set[int]) -> tuple[int | None, int]:
            tile = dense_tile_rows(dense_dtype, device) if batch_invariant else None
            return tile, dense_min_rows(dense_dtype, device, sorted(inputs))

        if layer_dtype == lm_head.dtype:  # one probe for all (lm_head's input is hidden)
            tile_rows, min_rows = head_rules = dense_rules(dtype, layer_inputs | {lm_head.shape[1]})
        else:
            tile_rows, min_rows = dense_rules(layer_dtype, layer_inputs)
            head_rules = dense_rules(lm_head.dtype, {lm_head.shape[1]})
        self.ops = row_ops(device, dtype)
        self.layers = [LlamaLayer(config, tensors, i, device, tile_rows, self.ops,
                                  min_rows)
                       for i in range(config.num_layers)]
        self.norm = tensors["norm"].to(device)
        self.lm_head = Linear(lm_head, low_bit_copy(tensors, "lm_head", lm_head.shape[0]),
                              *head_rules)
        self.rotary = RotaryEmbedding(config, max_len, device, tensors.get(ROPE_FREQS))
        self.windows = sorted({layer.window for layer in self.layers} - {None})
        self._fused = self._fused_layers()
        # Prompt rows at positions below this take the low-bit copies, where those are the
        # faster kernel for a few dozen rows (worker.model.quant's prefill_rows: the native
        # fp32 block kernels, 64); later ones the dense weights. By position, so a prompt
        # row's kernel, and a KV block's contents, depend on nothing but its tokens: not on
        # what shares the step, nor on how much of the prompt the prefix cache held, nor on
        # which prompt computed a shared cached block (ModelRunner). 0: dense throughout.
        # With int8 activations the layers' projections ignore it (Linear.int8_all_rows:
        # every row on the int8 block kernels).
        self.low_bit_prompt_positions = min(
            (lin.packed.prefill_rows if lin.packed is not None else 0)
            for layer in self.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        ) if self.layers else 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[KVCache] | None) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> hidden states [num_tokens, hidden] (pre-norm)."""
        cos, sin = self.rotary.tables(positions, self.dtype)
        x = F.embedding(input_ids, self.embed)  # [num_tokens, hidden]
        metas = {None: meta}
        if self.windows:
            block_size = kv_caches[0][0].shape[1] if kv_caches else 1
            metas.update({w: windowed(meta, w, block_size, self.dtype) for w in self.windows})
        # A step of decode rows only, read from the pool by the native kernel: the layers
        # that can call their kernels directly do (LlamaLayer.decode_native).
        all_decode = (kv_caches is not None and meta.paged_decode is not None
                      and not meta.prefills and meta.num_decode == x.shape[0])
        fused = self._fused
        if all_decode and fused is not None and meta.paged_decode.kernel is fused.attention:
            cfg, paged = self.config, meta.paged_decode
            return fused.module.decode_layers(
                x, cos, sin, fused.weights, fused.bits, fused.out_features,
                [pool for kv in kv_caches for pool in kv], meta.slot_mapping,
                paged.block_tables, paged.context_lens, cfg.num_heads, cfg.num_kv_heads,
                cfg.head_dim, cfg.rms_norm_eps, cfg.head_dim**-0.5, fused.int8_activations)
        for i, layer in enumerate(self.layers):
            if all_decode and layer.native is not None:
                x = layer.decode_native(x, cos, sin, kv_caches[i], meta)
            else:
                x = layer.forward(x, cos, sin, None if kv_caches is None else kv_caches[i],
                                  metas[layer.window])
        return x

    def _fused_layers(self) -> FusedLayers | None:
        """Where every layer can call its kernels directly (LlamaLayer.native), the native
        loop over all of them (worker/csrc/decode_layers.cpp) and its arguments."""
        if not self.layers or any(layer.native is None for layer in self.layers):
            return None
        module = self.layers[0].native
        weights, bits, out_features = [], [], []
        for layer in self.layers:
            linears = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
            weights += [layer.input_norm, layer.qkv.packed.data, layer.o_proj.packed.data,
                        layer.post_norm, layer.gate_up.packed.data, layer.down.packed.data]
            bits += [4 if isinstance(lin.packed, BlockQ4) else 8 for lin in linears]
            out_features += [lin.packed.out_features for lin in linears]
        int8 = all(lin.packed.int8_activations for layer in self.layers
                   for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
        return FusedLayers(module, module.decode_attention, weights, bits, out_features, int8)

    def use_int8_activations(self) -> int:
        """Every row of every layer's block products, prompt rows too (Linear.int8_all_rows),
        and the lm_head's decode rows (compute_logits' `decode`) quantize their activations
        to int8 (`--int8-activations`, worker/csrc/lowbit_int8.cpp); the lm_head's other
        rows keep fp32 activations. Nothing to do where there are no block copies (bf16's
        torch kernels, a GPU). -> how many products now take int8 activations."""
        linears = [lin for layer in self.layers
                   for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        blocks = [lin.packed for lin in [*linears, self.lm_head]
                  if isinstance(lin.packed, BlockQ4 | BlockQ8)]
        for packed in blocks:
            packed.use_int8_activations()
        # Prompt rows of the layers' projections take the int8 kernels too: 1.5x (512 rows)
        # to 2.2x (32 rows) less CPU than the bf16 GEMM on AVX512_BF16 (bench_block_kernels
        # --prompt-rows). Not the lm_head: the first token and prompt logprobs keep its
        # dense kernel (compute_logits).
        for lin in linears:
            lin.use_int8_all_rows()
        self._fused = self._fused_layers()
        return len(blocks)

    def compute_logits(self, hidden: torch.Tensor,
                       decode: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [num_rows, hidden] -> fp32 logits [num_rows, vocab]. `decode` [num_rows]
        bool: the rows that are decode rows, which take the lm_head's decode kernel (int8
        activations where they are on); None: none is."""
        h = self.ops.rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        packed = self.lm_head.packed
        if decode is None or not getattr(packed, "int8_activations", False):
            return self.lm_head(h).float()
        order = torch.argsort(~decode, stable=True)  # decode rows first; each row on its own
        logits = torch.empty(h.shape[0], packed.out_features, device=h.device)
        logits[order] = self.lm_head(h[order], None, int(decode.sum())).float()
        return logits

    def forward_unpaged(self, token_ids: list[int]) -> torch.Tensor:
        """Reference path: one sequence from scratch, no cache -> fp32 logits [len, vocab]."""
        n = len(token_ids)
        meta = AttentionMetadata(
            slot_mapping=None, num_decode=0, decode_groups=[],
            prefills=[PrefillSpan(0, n, None,
                                  causal_mask(0, n, self.config.num_queries_per_kv, self.device))],
        )
        ids = torch.tensor(token_ids, device=self.device)
        positions = torch.arange(n, device=self.device)
        return self.compute_logits(self.forward(ids, positions, meta, None))
