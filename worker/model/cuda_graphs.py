"""Piecewise CUDA graphs for the decode step (imported only when the worker's device is CUDA).

As vLLM's piecewise graphs: each layer's two segments (worker/model/segments.py) are captured
once per batch-size bucket and replayed, so a decode step launches two graphs per layer instead
of ~20 kernels each from Python; attention runs eagerly between them, because its shapes (the
context length, the number of length groups) change every step. A batch of n rows replays the
smallest bucket >= n: the rows are copied into the graph's static input buffers, the rows past
n hold stale values of earlier steps (finite, and never read back: every op is row-wise), and
the first n rows of the static outputs are the result. A batch above the largest bucket runs
eagerly.

Each graph keeps its own outputs alive, so no graph's replay overwrites another's results;
all share one memory pool for their intermediates.
"""

from __future__ import annotations

import logging

import torch

from zeroserve.worker.attention import AttentionMetadata, paged_attention
from zeroserve.worker.model.llama import KVCache, LlamaModel
from zeroserve.worker.model.segments import LayerTensors, is_pure_decode, make_segments
from zeroserve.worker.model.sliding_window import windowed

logger = logging.getLogger(__name__)


def buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch_size (vLLM's default sizes)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes += range(8, max_batch_size + 1, 8)
    if not sizes or sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


class _Bucket:
    """One batch size's graphs: two per layer, over shared static inputs."""

    def __init__(self, size: int, x: torch.Tensor, attn: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor):
        self.size = size
        self.x, self.attn, self.cos, self.sin = x[:size], attn[:size], cos[:size], sin[:size]
        self.attention_in: list[tuple[torch.cuda.CUDAGraph, tuple]] = []
        self.attention_out: list[tuple[torch.cuda.CUDAGraph, torch.Tensor]] = []


class CudaGraphDecode:
    def __init__(self, model: LlamaModel, max_batch_size: int):
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.max_batch_size = max_batch_size
        self.layers = [LayerTensors.of(layer) for layer in model.layers]
        self._attention_in, self._attention_out = make_segments(model.config)
        self._buckets: dict[int, _Bucket] = {}
        self._sizes = buckets(max_batch_size)

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return is_pure_decode(meta, num_tokens, self.max_batch_size)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Capture every bucket's graphs (largest first, so the pool is sized once)."""
        model, cfg = self.model, self.model.config
        size = self._sizes[-1]

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=model.dtype, device=model.device)

        x, attn = buffer(size, cfg.hidden_size), buffer(size, cfg.q_size)
        cos, sin = buffer(size, 1, cfg.head_dim), buffer(size, 1, cfg.head_dim)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(model.device)
        stream.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(stream):
            for layer in self.layers:  # library handles and workspaces, before any capture
                self._attention_in(x, cos, sin, *layer.attention_in_args())
                self._attention_out(x, attn, *layer.attention_out_args())
        torch.cuda.current_stream(model.device).wait_stream(stream)
        torch.cuda.synchronize(model.device)
        for size in reversed(self._sizes):
            bucket = _Bucket(size, x, attn, cos, sin)
            for layer in self.layers:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    qkv = self._attention_in(bucket.x, bucket.cos, bucket.sin,
                                             *layer.attention_in_args())
                bucket.attention_in.append((graph, qkv))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self._attention_out(bucket.x, bucket.attn, *layer.attention_out_args())
                bucket.attention_out.append((graph, out))
            self._buckets[size] = bucket
        torch.cuda.synchronize(model.device)
        logger.info("captured CUDA graphs for decode batches of %s rows", self._sizes)

    def _bucket(self, num_rows: int) -> _Bucket:
        return self._buckets[next(s for s in self._sizes if s >= num_rows)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[KVCache]) -> torch.Tensor:
        model = self.model
        n = input_ids.shape[0]
        bucket = self._bucket(n)
        cos, sin = model.rotary.tables(positions, model.dtype)
        bucket.cos[:n].copy_(cos)
        bucket.sin[:n].copy_(sin)
        x = torch.nn.functional.embedding(input_ids, model.embed)  # [n, hidden]
        metas = {None: meta}
        if model.windows:
            block_size = kv_caches[0][0].shape[1]
            metas.update({w: windowed(meta, w, block_size, model.dtype) for w in model.windows})
        scale = model.config.head_dim**-0.5
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(model.layers, kv_caches,
                                                            strict=True)):
            bucket.x[:n].copy_(x)
            graph, (q, k, v) = bucket.attention_in[i]
            graph.replay()
            attn = paged_attention(q[:n], k[:n], v[:n], k_cache, v_cache,
                                   metas[layer.window], scale)
            bucket.attn[:n].copy_(attn)
            graph, out = bucket.attention_out[i]
            graph.replay()
            x = out[:n]
        # The last graph's output buffer is overwritten by the next step's replay: a copy.
        return x.clone()
