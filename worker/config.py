"""Worker configuration: the engine's and the worker process's, frozen dataclasses validated
on creation."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from zeroserve.common.keys import check_plane_security, is_worker_id_valid
from zeroserve.worker.discovery import GatewayDns
from zeroserve.worker.speculative import SpeculativeConfig


class BatchingMode(enum.Enum):
    CONTINUOUS = "continuous"  # the product: sequences join and leave every step
    STATIC = "static"  # benchmark baseline: fixed padded batch, runs until the slowest ends
    DYNAMIC = "dynamic"  # benchmark baseline: gather for batch_wait_ms, then run to completion


ATTENTION_BACKENDS = ("auto", "native", "torch")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"  # "default" (embedded SmolLM2), a .gguf path, or a HF directory
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    dtype: str = "auto"  # "auto", "float32", "bfloat16", "float16"
    # The KV pool's dtype: "auto" (bfloat16 on the CPU for `--dtype auto` with int8
    # activations, else the activations'), "float32" or "bfloat16" (bf16 K/V under fp32
    # activations: half the pool's bytes and attention's reads; device.resolve_kv_dtype).
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # Prefill tokens a step may carry beside running decodes (chunked prefill as in Sarathi
    # and vLLM): a big chunk holds every stream's next token for its whole length (a
    # 512-token chunk costs about 40 decode steps of 15 rows on the CPU), so beside decodes
    # prompts advance in smaller chunks; a step with no decodes still takes
    # max_num_batched_tokens. 256: at 16 clients on 2 quiet cores the same tokens/s as no
    # cap, ITL p99 0.71x, TTFT p50 0.83x (128: ITL p99 0.63x but 0.89x tokens/s).
    # Beside more decodes than this, prefills may take as many tokens as there are decodes
    # (Scheduler._prefill_budget): a burst of arrivals beside hundreds of streams.
    # None: no separate cap.
    max_prefill_tokens_with_decodes: int | None = 256
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
    # Decode rows on the native block kernels (fp32 on the CPU) quantize their activations to
    # int8 per block of 32 and take integer dot products (worker/csrc/lowbit_int8.cpp);
    # prompt rows keep fp32 activations. Off: the fp32-activation reference path. None: on
    # with --dtype auto (it passed the quality gate, benchmarks/bench_quality.py), off with
    # an explicit dtype, so `--dtype float32` stays the exact reference (uses_int8_activations).
    int8_activations: bool | None = None
    # Exact batch invariance (docs/architecture.md, "Batch independence"): every row's result
    # is the same whatever shares its step, at a cost in throughput; off, the low-bit kernels
    # are chosen by the step's row count where that is faster (worker/model/llama.py).
    batch_invariant: bool = False
    # The decode step with each layer's small ops fused (worker/model/compiled.py): True runs
    # eagerly, False compiles (inductor on the CPU, CUDA graphs on CUDA), None: eager for now
    # (the CPU: compiling does not pay; CUDA: the graphs have not yet run on a GPU).
    enforce_eager: bool | None = None
    # Decode batches up to this many rows run compiled, larger ones eagerly; None: max_num_seqs.
    max_capture_batch_size: int | None = None
    # n-gram speculative decoding (worker/speculative.py); None: off.
    speculative_config: SpeculativeConfig | None = None
    # The box's KV tier (worker/kv_tier/): GiB of shared memory for full KV blocks that every
    # worker of the box reads (failover, restart, prefix reuse), 0: off; its folder (None:
    # /dev/shm/zeroserve-$UID/kv-tier); a disk level below it and that level's GiB.
    kv_offloading_size: float = 0.0
    kv_offloading_dir: str | None = None
    kv_tier_dir: str | None = None
    kv_tier_dir_size: float = 16.0
    # A CPU worker's KV pool is a file in the tier's folder (no copy per block) where it fits
    # (worker/kv_tier/pool_file.py); False: its own memory, full blocks copied into the tier.
    kv_pool_in_tier: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if (self.max_prefill_tokens_with_decodes is not None
                and self.max_prefill_tokens_with_decodes < 1):
            raise ValueError("max_prefill_tokens_with_decodes must be >= 1")
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
        if self.max_capture_batch_size is not None and self.max_capture_batch_size < 1:
            raise ValueError("max_capture_batch_size must be >= 1")
        if not 0 <= self.kv_offloading_size < 1 << 20:
            raise ValueError("kv_offloading_size must be >= 0 GiB")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        if not 0 < self.kv_tier_dir_size < 1 << 30:
            raise ValueError("kv_tier_dir_size must be > 0 GiB")

    @property
    def uses_int8_activations(self) -> bool:
        """int8_activations as set, or (None) on exactly when the dtype is auto."""
        if self.int8_activations is None:
            return self.dtype == "auto"
        return self.int8_activations


BACKENDS = ("model", "fake")


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    # The gateway's ROUTER (the worker connects a DEALER) and PULL (a PUSH for TOKENS).
    # Several gateways: one address each, in the same order (the i-th router and the i-th
    # tokens address are one gateway's). Empty with gateway_dns.
    router_address: str | tuple[str, ...]
    tokens_address: str | tuple[str, ...]
    engine: EngineConfig = field(default_factory=EngineConfig)
    backend: str = "model"  # "model" or "fake" (FakeRunner, tests/benchmarks only)
    heartbeat_interval_s: float = 0.5
    gateway_timeout_s: float = 5.0  # no gateway heartbeat for this long -> say HELLO again
    drain_timeout_s: float = 30.0
    fake_forward_s: float = 0.0  # backend "fake" only: simulated time of one forward
    fake_stamps_path: str | None = None  # backend "fake" only: when each token was made
    # A silent gateway: keep its streams (paused at their credit) this long, then fail them.
    gateway_grace_s: float = 120.0
    # No engine progress for this long: exit EXIT_STALLED (None: never; tests in-process).
    stall_timeout_s: float | None = 120.0
    max_step_failures: int = 3  # engine steps failing in a row before the worker exits
    # CurveZMQ keys (common/keys.py): required for tcp:// endpoints unless insecure.
    keys_dir: str | None = None
    insecure: bool = False
    # Gateways found by DNS (worker/discovery.py) instead of fixed addresses: one link per
    # address the name resolves to, re-resolved every gateway_dns.interval_s.
    gateway_dns: GatewayDns | None = None
    # What HELLO announces (the gateway routes by them): the name clients use for this
    # worker's model ("" : the gateway's default model) and its version label.
    served_model_name: str = ""
    model_version: str = "v1"

    def __post_init__(self) -> None:
        for name in ("served_model_name", "model_version"):
            value = getattr(self, name)
            if len(value) > 256 or not value.isprintable() or value != value.strip():
                raise ValueError(f"{name} must be printable, at most 256 characters")
        if not self.model_version:
            raise ValueError("model_version must not be empty")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {self.backend!r}")
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be > 0")
        if self.gateway_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("gateway_timeout_s must be longer than heartbeat_interval_s")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.fake_forward_s < 0:
            raise ValueError("fake_forward_s must be >= 0")
        if self.gateway_grace_s < self.gateway_timeout_s:
            raise ValueError("gateway_grace_s must be >= gateway_timeout_s")
        if self.stall_timeout_s is not None and self.stall_timeout_s <= 0:
            raise ValueError("stall_timeout_s must be > 0")
        if self.max_step_failures < 1:
            raise ValueError("max_step_failures must be >= 1")
        if not is_worker_id_valid(self.worker_id):
            raise ValueError(f"worker_id {self.worker_id!r}: use up to 128 letters, digits, "
                             "'.', '_' or '-'")
        endpoints = self.gateway_endpoints
        if self.gateway_dns is not None:
            if endpoints:
                raise ValueError("give gateway addresses or a gateway DNS name, not both")
            endpoints = [self.gateway_dns.example_endpoints]
        if not endpoints:
            raise ValueError("give at least one gateway router and tokens address")
        if len({address for pair in endpoints for address in pair}) != 2 * len(endpoints):
            raise ValueError("every gateway address must be different")
        check_plane_security(tuple(a for pair in endpoints for a in pair), self.keys_dir,
                             self.insecure)

    @property
    def gateway_endpoints(self) -> list[tuple[str, str]]:
        """(router, tokens) address pairs, one per gateway."""
        routers, tokens = _addresses(self.router_address), _addresses(self.tokens_address)
        if len(routers) != len(tokens):
            raise ValueError(f"{len(routers)} router addresses but {len(tokens)} tokens "
                             "addresses: give one of each per gateway")
        return list(zip(routers, tokens, strict=True))


def _addresses(value: str | tuple[str, ...]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)
