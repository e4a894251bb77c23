"""The decode forward with each layer's small ops fused (inductor on the CPU, CUDA graphs on CUDA).

A pure decode step (every row one token of its own sequence) runs each layer as two compiled
segments (worker/model/segments.py) with attention between them, eagerly: the paged cache is
read through per-step block tables by the native kernel or the torch path, which stay opaque
to the compiler. Any other step (a prefill chunk, a speculative verify, a batch above
`max_batch_size`) takes the eager LlamaModel.forward.

On the CPU the segments are compiled by torch.compile (inductor) once, with the row count
unbacked (a symbol with no guard on its value), so one graph serves every batch size from 1
up, and its code computes every row the same way whatever the batch: the batch-independence
rule (docs/architecture.md) holds for the compiled path as it does for the eager one. The
compilation runs at start (`warm_up`, the `compile` start-up phase) and inductor's FX graph
cache lives under zeroserve's cache directory (`$ZEROSERVE_CACHE_DIR/inductor`), so a restarted
worker loads the compiled code instead of compiling again.

`EngineConfig.enforce_eager` (`--enforce-eager`): True never compiles, False always does,
None (the default) runs eagerly everywhere for now. On CUDA the CUDA-graph path
(worker/model/cuda_graphs.py) has never run on a GPU (no GPU was lent while it was written):
it becomes the CUDA default once its CUDA-marked test has passed there. On the CPU eager,
because measured the fused segments did not make a step faster, a first compile costs 45-120 s
of start-up and a start with the cache in place still 5-30 s (importing inductor, dynamo
tracing), over the 3 s restart budget (docs/benchmarks.md, "A compiled decode step").
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

from zeroserve.worker.attention import AttentionMetadata, paged_attention
from zeroserve.worker.model.llama import KVCache, LlamaModel
from zeroserve.worker.model.segments import LayerTensors, is_pure_decode, make_segments
from zeroserve.worker.model.sliding_window import windowed

logger = logging.getLogger(__name__)

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
INDUCTOR_OPTIONS = {
    # Round every intermediate to the model dtype where eager does (bf16 after each op):
    # fused code would otherwise keep fp32 between ops and differ from the eager path by
    # more than the last bit (reductions may still round differently).
    "emulate_precision_casts": True,
    # One thread in the fused loops: a decode step's elementwise work is a few thousand values
    # a row, and the row count is unknown at compile time, so inductor would otherwise fork
    # OpenMP threads for every loop (the projections, extern kernels, keep torch's threads).
    "cpp.threads": 1,
}


def wants_compiled(enforce_eager: bool | None, device: torch.device) -> bool:
    """Whether this worker runs the compiled decode step (see the module docstring)."""
    if enforce_eager is not None:
        return not enforce_eager
    return False  # see the module docstring: CUDA graphs become CUDA's default once run there


def use_cache_dir(directory: Path) -> Path:
    """Point inductor's on-disk caches at `directory`, unless the operator already chose one
    ($TORCHINDUCTOR_CACHE_DIR). Read by inductor when it first compiles."""
    chosen = os.environ.get(INDUCTOR_CACHE_ENV)
    if chosen:
        return Path(chosen)
    directory.mkdir(parents=True, exist_ok=True)
    os.environ[INDUCTOR_CACHE_ENV] = str(directory)
    return directory


def compiler_available() -> bool:
    """inductor's CPU code needs a C++ compiler."""
    return any(shutil.which(name) for name in ("g++", "c++", "clang++"))


class CompiledDecode:
    """Runs decode steps of up to max_batch_size rows through compiled layer segments."""

    def __init__(self, model: LlamaModel, max_batch_size: int):
        self.model = model
        self.max_batch_size = max_batch_size
        self.layers = [LayerTensors.of(layer) for layer in model.layers]
        attention_in, attention_out = make_segments(model.config)
        # fullgraph: a graph break would silently bring Python dispatch back.
        self._attention_in = torch.compile(attention_in, fullgraph=True, dynamic=False,
                                           options=INDUCTOR_OPTIONS)
        self._attention_out = torch.compile(attention_out, fullgraph=True, dynamic=False,
                                            options=INDUCTOR_OPTIONS)

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return is_pure_decode(meta, num_tokens, self.max_batch_size)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile (or load from the cache) every layer kind's segments on dummy rows."""
        model, cfg = self.model, self.model.config
        rows = 2
        x = torch.zeros(rows, cfg.hidden_size, dtype=model.dtype, device=model.device)
        attn = torch.zeros(rows, cfg.q_size, dtype=model.dtype, device=model.device)
        cos, sin = model.rotary.tables(torch.zeros(rows, dtype=torch.long,
                                                   device=model.device), model.dtype)
        for t in (x, attn, cos, sin):
            # One graph for every row count, 1 included, with no size guard: the row count
            # is unbacked, so inductor's code never branches on it.
            torch._dynamo.decorators.mark_unbacked(t, 0)
        for layer in self.layers:  # layers of another kind (biases, quant type) compile too
            self._attention_in(x, cos, sin, *layer.attention_in_args())
            self._attention_out(x, attn, *layer.attention_out_args())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[KVCache]) -> torch.Tensor:
        """As LlamaModel.forward, for a step can_run() accepts."""
        model = self.model
        cos, sin = model.rotary.tables(positions, model.dtype)
        x = torch.nn.functional.embedding(input_ids, model.embed)  # [num_tokens, hidden]
        metas = {None: meta}
        if model.windows:
            block_size = kv_caches[0][0].shape[1]
            metas.update({w: windowed(meta, w, block_size, model.dtype) for w in model.windows})
        scale = model.config.head_dim**-0.5
        for layer, tensors, (k_cache, v_cache) in zip(model.layers, self.layers, kv_caches,
                                                      strict=True):
            q, k, v = self._attention_in(x, cos, sin, *tensors.attention_in_args())
            attn = paged_attention(q, k, v, k_cache, v_cache, metas[layer.window], scale)
            x = self._attention_out(x, attn, *tensors.attention_out_args())
        return x


def build(model: LlamaModel, enforce_eager: bool | None, max_batch_size: int,
          cache_dir: Path) -> CompiledDecode | None:
    """The compiled decode step for this model, warmed up; None to run eagerly (asked for, or
    impossible here: then a log line says why, and the worker starts all the same)."""
    if not wants_compiled(enforce_eager, model.device):
        return None
    try:
        if model.device.type == "cuda":
            from zeroserve.worker.model.cuda_graphs import CudaGraphDecode  # CUDA only

            step = CudaGraphDecode(model, max_batch_size)
        else:
            if not compiler_available():
                logger.warning("no C++ compiler for torch.compile: running the decode step "
                               "eagerly")
                return None
            use_cache_dir(cache_dir)
            step = CompiledDecode(model, max_batch_size)
        step.warm_up()
        return step
    except Exception:  # noqa: BLE001 - a compiler failure must never stop the worker
        logger.exception("compiling the decode step failed: running it eagerly")
        return None
