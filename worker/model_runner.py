"""ModelRunner: a scheduler plan -> one forward over the flattened batch -> sampled tokens."""

from __future__ import annotations

import itertools
import logging
import math
import mmap
import time
from dataclasses import dataclass, field

import torch

from zeroserve.worker import cpu_kernels, verify, weight_cache
from zeroserve.worker.attention import (
    NATIVE_PROMPT_POSITIONS,
    AttentionMetadata,
    DecodeGroup,
    DecodeKernel,
    PagedDecode,
    PrefillSpan,
    causal_mask,
)
from zeroserve.worker.config import EngineConfig
from zeroserve.worker.device import (
    default_kv_cache_bytes,
    resolve_device,
    resolve_kv_dtype,
    resolve_precision,
)
from zeroserve.worker.model import compiled
from zeroserve.worker.model.info import ModelInfo
from zeroserve.worker.model.llama import KVCache
from zeroserve.worker.model.loader import load_model
from zeroserve.worker.outputs import StepTiming
from zeroserve.worker.plan import SampledToken, ScheduledChunk, SchedulerOutput
from zeroserve.worker.sampler import Sampler
from zeroserve.worker.startup import StartupTimer
from zeroserve.worker.weight_cache import WeightCache

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """The tensors of one step. Rows are ordered decodes first, then prefill chunks."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampled] row of each sampling chunk's last token
    sample_chunks: list[ScheduledChunk]  # in plan order, matching sample_rows
    # Chunks of requests that want prompt logprobs, with the row of their first token.
    prompt_rows: list[tuple[ScheduledChunk, int]] = field(default_factory=list)


def _native_prompt_rows(chunk: ScheduledChunk) -> int:
    """How many of a prefill chunk's first rows the native prompt kernel computes: those at
    positions below NATIVE_PROMPT_POSITIONS (worker/attention.py)."""
    return min(len(chunk.token_ids), max(0, NATIVE_PROMPT_POSITIONS - chunk.start_pos))


class ModelRunner:
    def __init__(self, config: EngineConfig, timer: StartupTimer | None = None):
        timer = timer or StartupTimer()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        started = time.perf_counter()
        with timer.phase("device"):
            self.device = resolve_device(config.device)
            if self.device.type == "cuda":
                # Allocations that name no index (workspaces, library handles) land on our GPU.
                torch.cuda.set_device(self.device)
            self.dtype, prompt_dtype = resolve_precision(config.dtype, self.device)
            self.kv_dtype = resolve_kv_dtype(
                config.kv_cache_dtype, self.dtype, self.device,
                production=config.dtype == "auto" and config.uses_int8_activations)
        self.model, self.info = load_model(config.model, self.device, self.dtype,
                                           config.max_model_len, _weight_cache(config), timer,
                                           config.batch_invariant, prompt_dtype,
                                           config.uses_int8_activations)
        self.block_size = config.block_size
        with timer.phase("kv_cache"):
            self.num_kv_blocks = self._pool_size(config, self.info)
            self.kv_caches = self._allocate_kv(config, self.info)
        self.sampler = Sampler(self.info.vocab_size, self.info.eos_token_ids, self.device,
                               config.seed)
        self.group = self.model.config.num_queries_per_kv
        applied = config.uses_int8_activations and self.model.use_int8_activations()
        if config.int8_activations and not applied:  # asked for by name, not by auto
            logger.warning("--int8-activations: no 4-bit or 8-bit block copies here (they "
                           "exist in float32 on the CPU); every row keeps its activations")
        with timer.phase("kernel"):
            self.decode_kernel = self._decode_kernel(config.attention_backend)
        # Where decode rows are batch-independent (the CPU; not verified on CUDA), produced
        # tokens computed again take them (_prepare).
        self._outputs_as_decode_rows = self.device.type == "cpu"
        with timer.phase("compile"):
            # Pure decode steps through fused layer segments, or None: all steps eager.
            self.decode_step = compiled.build(
                self.model, config.enforce_eager,
                config.max_capture_batch_size or config.max_num_seqs,
                weight_cache.default_directory().parent / "inductor")
        self.last_timing = StepTiming()
        self.last_prompt_logprobs: dict[str, tuple[int, list]] = {}
        logger.info(
            "loaded %s on %s (%s) in %.1fs: %d KV blocks of %d tokens, context %d, "
            "%s decode attention, weight cache %s, %s decode step",
            self.info.name, self.info.device, self.info.dtype, time.perf_counter() - started,
            self.num_kv_blocks, self.block_size, self.info.max_model_len,
            "native" if self.decode_kernel is not None else "torch",
            timer.notes.get("weight_cache", "off"),
            "eager" if self.decode_step is None else type(self.decode_step).__name__,
        )

    def _decode_kernel(self, backend: str) -> DecodeKernel | None:
        """The native decode attention kernel, or None for the torch path."""
        if backend == "torch":
            return None
        supported = self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float32)
        if backend == "native":
            if not supported:
                raise ValueError("the native attention kernel runs on the CPU in bfloat16 or "
                                 f"float32, not on {self.device} in {self.dtype}")
            return cpu_kernels.load(required=True).decode_attention
        # auto: the native kernel wherever it builds; it agrees with the torch path to
        # rounding (fp32 sums, an exp with relative error ~2e-7), and reads the pool in place
        # where the torch path gathers every sequence's context with index_select first.
        if supported:
            module = cpu_kernels.load()
            return None if module is None else module.decode_attention
        return None

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        info = self.info
        element = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * info.num_layers * self.block_size * info.num_kv_heads * info.head_dim * element

    def _pool_size(self, config: EngineConfig, info: ModelInfo) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_memory is not None:
            num_blocks = config.kv_cache_memory // self.kv_block_bytes
        else:
            # More blocks than every sequence at full length could use is wasted memory.
            useful = config.max_num_seqs * math.ceil(info.max_model_len / self.block_size)
            num_blocks = min(default_kv_cache_bytes(self.device) // self.kv_block_bytes, useful)
        if num_blocks < 1:
            raise ValueError("the KV cache budget is smaller than one block")
        return int(num_blocks)

    def _allocate_kv(self, config: EngineConfig, info: ModelInfo) -> list[KVCache]:
        """One pool for all layers, K and V. Every slot must hold finite values before it is
        first written: padded attention reads unwritten slots and weighs them by 0, and
        0 * NaN would leak. On the CPU the pool is a fresh anonymous mapping, which the OS
        hands out zeroed, page by page as blocks are first touched: no zero-fill pass at
        start, and no memory committed for blocks never used (or, with the KV tier on, a new
        file in the tier's folder: the same, and its full blocks are published without a
        copy, worker/kv_tier/pool_file.py). On a GPU zeroing is a fast
        memset (and the caching allocator may hand back dirty memory)."""
        shape = (info.num_layers, 2, self.num_kv_blocks, self.block_size, info.num_kv_heads,
                 info.head_dim)
        in_tier = None
        if self.device.type == "cpu" and config.kv_offloading_size:
            from zeroserve.worker.kv_tier.setup import allocate_pool  # the tier's file, or None

            in_tier = allocate_pool(config, info, self.block_size, shape, self.kv_dtype)
        self.kv_pool_file = None if in_tier is None else in_tier[1]  # the KV tier's, or None
        if in_tier is not None:
            pool = in_tier[0]  # zeroed too (a new file), shared with the tier's readers
        elif self.device.type == "cpu":
            pool = _zeroed_cpu_tensor(shape, self.kv_dtype)
        else:
            pool = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.kv_pool = pool  # the KV tier's view (worker/kv_tier/connector.py)
        return [(pool[i, 0], pool[i, 1]) for i in range(info.num_layers)]

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> list[SampledToken]:
        timing = StepTiming(num_tokens=plan.num_tokens, num_seqs=len(plan.chunks))
        self.last_timing = timing
        if plan.is_empty:
            return []
        started = time.perf_counter()
        inputs = self._prepare(plan.chunks)
        # One sampled row per chunk, or 1 + k for a chunk with k drafts (worker/verify.py).
        row_chunks, row_counts = verify.expand(inputs.sample_chunks)
        self.sampler.prepare(row_chunks)  # grammar masks, while the model runs
        prepared = time.perf_counter()
        forward = self.model.forward
        if self.decode_step is not None and self.decode_step.can_run(
                inputs.meta, inputs.input_ids.shape[0]):
            forward = self.decode_step.forward
        hidden = forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        logits = None
        if inputs.sample_chunks:
            logits = self.model.compute_logits(hidden[inputs.sample_rows],
                                               inputs.sample_rows < inputs.meta.num_decode)
        if self.device.type == "cuda":
            # Kernels run asynchronously: without this the forward's GPU time would show up
            # as sampling (the sampler's first .tolist() waits for it anyway).
            torch.cuda.synchronize(self.device)
        forwarded = time.perf_counter()
        sampled = [] if logits is None else self.sampler.sample(logits, row_chunks)
        if len(row_chunks) != len(inputs.sample_chunks):
            sampled = verify.accept(inputs.sample_chunks, row_counts, sampled)
        # request id -> (first prompt position, entries); see Engine.step.
        self.last_prompt_logprobs = self.sampler.prompt_logprobs(
            self.model.compute_logits, hidden, inputs.prompt_rows)
        finished = time.perf_counter()
        timing.prepare_s = prepared - started
        timing.forward_s = forwarded - prepared
        timing.sample_s = finished - forwarded
        return sampled

    def _slots(self, block_tables: list[list[int]], length: int) -> torch.Tensor:
        """[num_seqs, length] pool slots of positions 0 .. length-1 (tables padded with 0)."""
        num_blocks = math.ceil(length / self.block_size)
        tables = torch.tensor(_padded_tables(block_tables, num_blocks),
                              dtype=torch.long)  # [num_seqs, num_blocks]
        offsets = torch.arange(self.block_size)
        slots = (tables[:, :, None] * self.block_size + offsets).view(len(block_tables), -1)
        return slots[:, :length]

    def _prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        # Decodes first, shortest context first, so that similar lengths sit together. A
        # chunk with k drafts runs as 1 + k decode rows (row i at start_pos + i, attending
        # to the K/V its earlier rows write in the same layer): each row is computed exactly
        # as plain decoding computes that position (the same kernels, batch-independent),
        # so greedy tokens with speculation are the tokens without it.
        # Then the prefill chunks, those at early positions first (their rows take the
        # low-bit kernels with the decode rows: _low_bit_rows). A prompt's last token left
        # alone by a prefix-cache hit is a prefill row too, as when the whole prompt runs: a
        # row's kernels follow from what it is, never from its step.
        # A stream that moved here (failover, drain) or was preempted computes again the
        # tokens it produced: those rows run as the decode rows that first computed them,
        # one per position (_output_rows), so its K/V and its next token's logits are bit
        # for bit the undisturbed run's, not prompt rows' (other kernels: equal to rounding).
        verify_rows = {id(c): _verify_rows(c) for c in chunks if c.draft_token_ids}
        output_rows = {id(c): _output_rows(c) for c in chunks
                       if self._outputs_as_decode_rows and _has_output_rows(c)}
        # A chunk run as single-token decode rows -> its rows.
        split = {**verify_rows, **{key: rows for key, (_, rows) in output_rows.items()}}
        decodes = sorted((r for c in chunks for r in (
            split.get(id(c)) or ((c,) if _is_decode(c) else ()))), key=lambda c: c.start_pos)
        prefills = sorted([*(c for c in chunks if not _is_decode(c) and id(c) not in split),
                           *(part for part, _ in output_rows.values() if part is not None)],
                          key=lambda c: c.start_pos)
        ordered = decodes + prefills
        input_ids: list[int] = []
        positions: list[int] = []
        last_row: dict[int, int] = {}  # id(chunk) -> its last row
        for chunk in ordered:
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.context_len))
            last_row[id(chunk)] = len(input_ids) - 1
        positions_t = torch.tensor(positions, dtype=torch.long)
        blocks = torch.tensor([t for c in ordered for t in
                               _row_blocks(c, self.block_size)], dtype=torch.long)
        meta = AttentionMetadata(
            slot_mapping=blocks * self.block_size + positions_t % self.block_size,
            num_decode=len(decodes), decode_groups=[], prefills=[],
            low_bit_rows=_low_bit_rows(len(decodes), prefills,
                                       self.model.low_bit_prompt_positions),
        )
        if self.decode_kernel is not None:
            meta.paged_decode = self._paged_decode(decodes)
            meta.paged_prompt = self._paged_prompt(prefills, len(decodes))
        else:
            lengths = [c.context_len for c in decodes]
            for start, end in group_by_length(lengths, self.block_size):
                meta.decode_groups.append(self._decode_group(decodes[start:end], start))
        row = len(decodes)
        for chunk in prefills:
            span = self._prefill_span(chunk, row)
            if meta.paged_prompt is not None:  # its first rows go through the native kernel
                span.native_rows = _native_prompt_rows(chunk)
            meta.prefills.append(span)
            row += len(chunk.token_ids)
        sample_chunks = [c for c in chunks if c.do_sample]
        # A chunk with drafts samples at each of its 1 + k rows (worker/verify.py).
        # A chunk whose outputs were computed again samples at its last row only.
        sample_rows = [last_row[id(r)] for c in sample_chunks
                       for r in (verify_rows.get(id(c)) or split.get(id(c), (c,))[-1:])]
        return self._to_device(StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long),
            positions=positions_t,
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long),
            sample_chunks=sample_chunks,
            prompt_rows=[(c, last_row[id(c)] - len(c.token_ids) + 1) for c in chunks
                         if c.params.prompt_logprobs is not None and id(c) not in verify_rows],
        ))

    def _paged_decode(self, decodes: list[ScheduledChunk]) -> PagedDecode | None:
        if not decodes:
            return None
        num_blocks = math.ceil(max(c.context_len for c in decodes) / self.block_size)
        tables = _padded_tables([c.block_table for c in decodes], num_blocks)
        return PagedDecode(
            kernel=self.decode_kernel,
            block_tables=torch.tensor(tables, dtype=torch.int32),
            context_lens=torch.tensor([c.context_len for c in decodes], dtype=torch.int32),
        )

    def _paged_prompt(self, prefills: list[ScheduledChunk], first_row: int
                      ) -> PagedDecode | None:
        """The prefill rows at positions below NATIVE_PROMPT_POSITIONS for the native kernel:
        its chunk's table, and as context the positions up to its own (causal). The chunks'
        rows start at batch row `first_row`."""
        native = [_native_prompt_rows(c) for c in prefills]
        if not any(native):
            return None
        num_blocks = math.ceil(max(c.start_pos + m for c, m in zip(prefills, native, strict=True))
                               / self.block_size)
        tables = torch.tensor(_padded_tables([c.block_table for c in prefills], num_blocks),
                              dtype=torch.int32)  # [num_chunks, num_blocks]
        rows = None
        if any(m < len(c.token_ids) for c, m in zip(prefills, native, strict=True)):
            starts = itertools.accumulate((len(c.token_ids) for c in prefills), initial=first_row)
            rows = torch.cat([torch.arange(start, start + m)
                              for start, m in zip(starts, native, strict=False)])
        return PagedDecode(
            kernel=self.decode_kernel,
            block_tables=tables.repeat_interleave(torch.tensor(native), dim=0),  # [rows, blocks]
            context_lens=torch.cat([torch.arange(c.start_pos + 1, c.start_pos + m + 1,
                                                 dtype=torch.int32)
                                    for c, m in zip(prefills, native, strict=True)]),
            rows=rows,
        )

    def _decode_group(self, decodes: list[ScheduledChunk], start: int) -> DecodeGroup:
        context_lens = torch.tensor([c.context_len for c in decodes], dtype=torch.long)
        # Whole blocks: attention gathers block by block and masks the padding.
        num_blocks = math.ceil(int(context_lens.max()) / self.block_size)
        tables = _padded_tables([c.block_table for c in decodes], num_blocks)
        blocks = torch.tensor(tables, dtype=torch.long).flatten()  # [num_rows * num_blocks]
        max_context = num_blocks * self.block_size
        is_padding = torch.arange(max_context)[None, :] >= context_lens[:, None]
        bias = torch.zeros(len(decodes), 1, max_context, dtype=self.dtype).masked_fill_(
            is_padding.view(len(decodes), 1, max_context), float("-inf")
        )
        return DecodeGroup(start, start + len(decodes), blocks, bias, max_context)

    def _prefill_span(self, chunk: ScheduledChunk, row: int) -> PrefillSpan:
        n = len(chunk.token_ids)
        context_slots = None
        if chunk.start_pos > 0:
            context_slots = self._slots([chunk.block_table], chunk.context_len)[0]
        mask = causal_mask(chunk.start_pos, n, self.group, torch.device("cpu"))
        return PrefillSpan(row, row + n, context_slots, mask)

    def _to_device(self, inputs: StepInputs) -> StepInputs:
        if self.device.type == "cpu":
            return inputs

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory().to(self.device, non_blocking=True)

        meta = inputs.meta
        meta.slot_mapping = move(meta.slot_mapping)
        for group in meta.decode_groups:
            group.blocks = move(group.blocks)
            group.bias = move(group.bias)
        for span in meta.prefills:
            span.context_slots = move(span.context_slots)
            span.mask = move(span.mask)
        inputs.input_ids = move(inputs.input_ids)
        inputs.positions = move(inputs.positions)
        inputs.sample_rows = move(inputs.sample_rows)
        return inputs


def _zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over a private anonymous mapping: zero by the kernel's guarantee, committed
    only as pages are touched. The tensor keeps the mapping alive."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


def _weight_cache(config: EngineConfig) -> WeightCache | None:
    if not config.weight_cache:
        return None
    if config.weight_cache_dir is not None:
        return WeightCache(config.weight_cache_dir)
    return WeightCache(weight_cache.default_directory())


def _padded_tables(block_tables: list[list[int]], num_blocks: int) -> list[list[int]]:
    """Each table's first num_blocks entries, padded with block 0 (never read unmasked)."""
    return [t[:num_blocks] + [0] * (num_blocks - len(t[:num_blocks])) for t in block_tables]


def _is_decode(chunk: ScheduledChunk) -> bool:
    """One token past the prompt: a generated token's row (a preempted sequence recomputing
    its outputs runs them as prefill chunks, and a lone one of them as a decode)."""
    return len(chunk.token_ids) == 1 and chunk.start_pos >= len(chunk.prompt_token_ids)


def _low_bit_rows(num_decode: int, prefills: list[ScheduledChunk], below: int
                  ) -> int | tuple[torch.Tensor, torch.Tensor]:
    """The rows that take the low-bit kernels (worker.model.linear.LowBitRows): the decode
    rows, then every prefill row at a position below `below`. A count where those are the
    first rows (the chunks come in order of start position), else the two sets of rows."""
    if not prefills:
        return num_decode  # a decode step: every row
    low: list[int] = list(range(num_decode))
    row = num_decode
    for chunk in prefills:
        num_early = min(max(below - chunk.start_pos, 0), len(chunk.token_ids))
        low.extend(range(row, row + num_early))
        row += len(chunk.token_ids)
    if not low or low[-1] == len(low) - 1:
        return len(low)
    is_low = torch.zeros(row, dtype=torch.bool)
    is_low[low] = True
    return (torch.tensor(low, dtype=torch.long),
            torch.arange(row, dtype=torch.long)[~is_low])


def _has_output_rows(chunk: ScheduledChunk) -> bool:
    """A chunk of more than one token reaching past its prompt (tokens the sequence already
    produced, computed again), without drafts and without prompt logprobs (which read its
    prompt rows as one chunk)."""
    return (len(chunk.token_ids) > 1 and not chunk.draft_token_ids
            and chunk.context_len > len(chunk.prompt_token_ids)
            and chunk.params.prompt_logprobs is None)


def _output_rows(chunk: ScheduledChunk) -> tuple[ScheduledChunk | None, list[ScheduledChunk]]:
    """-> (its prompt tokens as a prefill chunk, or None; its output tokens as one
    single-token decode chunk each, in order: row i at its own position, attending to the K/V
    the rows before it write in the same layer, as with drafts)."""
    num_prompt = max(0, len(chunk.prompt_token_ids) - chunk.start_pos)
    part = None
    if num_prompt:
        part = ScheduledChunk(chunk.request_id, chunk.token_ids[:num_prompt], chunk.start_pos,
                              chunk.block_table, False, chunk.params, chunk.prompt_token_ids,
                              chunk.output_token_ids)
    return part, _single_token_rows(chunk, num_prompt)


def _verify_rows(chunk: ScheduledChunk) -> list[ScheduledChunk]:
    """A chunk with drafts as one single-token decode chunk per token, in order."""
    return _single_token_rows(chunk, 0)


def _single_token_rows(chunk: ScheduledChunk, skip: int) -> list[ScheduledChunk]:
    """chunk's tokens after its first `skip`, one single-token decode chunk each, in order."""
    return [ScheduledChunk(chunk.request_id, [token], chunk.start_pos + i, chunk.block_table,
                           True, chunk.params, chunk.prompt_token_ids, chunk.output_token_ids)
            for i, token in enumerate(chunk.token_ids[skip:], start=skip)]


def _row_blocks(chunk: ScheduledChunk, block_size: int) -> list[int]:
    """The physical block of each of the chunk's new tokens."""
    table = chunk.block_table
    return [table[p // block_size] for p in range(chunk.start_pos, chunk.context_len)]


# Decode rows are split by context length only when it saves this share of the padded
# attention work, and at least this many token slots: each group costs ~12 more ops per layer.
MIN_GROUP_SAVING = 0.25
MIN_GROUP_SAVED_SLOTS = 4096
MAX_DECODE_GROUPS = 4


def group_by_length(lengths: list[int], block_size: int) -> list[tuple[int, int]]:
    """Split rows sorted by context length into [start, end) groups, each padded to its own
    longest row rather than the batch's, where that saves enough work."""
    if not lengths:
        return []
    padded = [math.ceil(n / block_size) * block_size for n in lengths]
    groups = [(0, len(padded))]
    while len(groups) < MAX_DECODE_GROUPS:
        best = None  # (saved slots, group index, split point)
        for g, (start, end) in enumerate(groups):
            cost = (end - start) * padded[end - 1]
            for split in range(start + 1, end):
                saved = cost - (split - start) * padded[split - 1] - (end - split) * padded[end - 1]
                if saved >= max(MIN_GROUP_SAVED_SLOTS, MIN_GROUP_SAVING * cost) and (
                    best is None or saved > best[0]
                ):
                    best = (saved, g, split)
        if best is None:
            break
        _saved, g, split = best
        start, end = groups[g]
        groups[g : g + 1] = [(start, split), (split, end)]
    return groups
