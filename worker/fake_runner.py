"""FakeRunner: a Runner with no model, for tests and for benchmarking everything around the model.

Next tokens are a cheap deterministic function of (last token, position, seed), never an EOS
id unless `eos_after` asks for one. It keeps a simulated KV cache (the token written at every
slot of the pool) and checks every plan it gets, so engine tests catch scheduler and block
manager bugs the way a real model would show them as garbage text: block tables must cover
the context, the cached positions must hold this sequence's tokens (prefix caching and
preemption), no two chunks may write into the same block or into a block another chunk reads,
and the batch must respect the token budget and the sequence cap.
"""

from __future__ import annotations

import atexit
import json
import time
from collections import deque

from zeroserve.worker import verify
from zeroserve.worker.config import BatchingMode, EngineConfig
from zeroserve.worker.model.info import ModelInfo
from zeroserve.worker.outputs import StepTiming
from zeroserve.worker.plan import SampledToken, ScheduledChunk, SchedulerOutput

DEFAULT_NUM_KV_BLOCKS = 2048
# Without --num-kv-blocks the simulated pool also gives each of max_num_seqs sequences this
# many blocks (1,024 tokens at the default block size): the fake has no memory to run out
# of, and `serve --backend fake --max-num-seqs 1000` should not preempt at a fixed 2,048.
BLOCKS_PER_SEQ = 64
DEFAULT_MAX_MODEL_LEN = 8192
VOCAB_SIZE = 49152
EOS_TOKEN_ID = 2


class InvalidPlanError(AssertionError):
    """The scheduler produced a plan a real runner would compute garbage (or crash) on."""


class FakeRunner:
    # Its simulated device queues launches, as a CUDA stream does: a plan launched before
    # the last one is collected starts when that one's device time ends, and a follower's
    # pending tokens (SchedulerOutput.prev_rows) are taken from the last launch's samples.
    can_follow = True

    def __init__(
        self,
        config: EngineConfig,
        *,
        forward_time_s: float = 0.0,  # device time per execute() (a forward), slept out
        per_token_time_s: float = 0.0,  # extra device time per scheduled token
        eos_after: int | None = None,  # emit EOS as output token number eos_after + 1
        check_plans: bool = True,  # validate plans and simulate the KV cache (O(context))
        # Benchmarks: record [first prompt token, output index, monotonic time] for every
        # token made, written as JSON to this path at exit (the relay benchmark's added
        # latency is a client's receive time minus this).
        stamps_path: str | None = None,
        # An input-grounded fake: the next token is the one that followed the latest earlier
        # occurrence of the last token in the context (copying, as a model rewriting a text
        # does), where there is one. Speculative decoding's tests use it.
        copy_context: bool = False,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.num_kv_blocks = config.num_kv_blocks or max(
            DEFAULT_NUM_KV_BLOCKS, config.max_num_seqs * BLOCKS_PER_SEQ)
        self.info = ModelInfo(
            name="fake",
            path="fake",
            max_model_len=config.max_model_len or DEFAULT_MAX_MODEL_LEN,
            vocab_size=VOCAB_SIZE,
            eos_token_ids=(EOS_TOKEN_ID,),
            bos_token_id=1,
            num_layers=30,
            num_kv_heads=3,
            head_dim=64,
            device="cpu",
            dtype="float32",
        )
        self.last_timing = StepTiming()
        self.forward_time_s = forward_time_s
        self.per_token_time_s = per_token_time_s
        self.eos_after = eos_after
        self.copy_context = copy_context
        self.check_plans = check_plans
        self.num_steps = 0
        self.num_computed_tokens = 0
        # Launched, not collected yet, oldest first: (perf_counter time its device time
        # ends, its tokens, its timing).
        self._launched: deque[tuple[float, list[SampledToken], StepTiming]] = deque()
        self._last_sampled: list[SampledToken] = []  # the last launch's tokens
        self._done_at = 0.0  # perf_counter time the last launched plan's device time ends
        # Per step: (when its tokens count as made, [(first prompt token, output index)]).
        self._stamps: list[tuple[float, list[tuple[int, int]]]] | None = None
        if stamps_path is not None:
            self._stamps = []
            atexit.register(self._write_stamps, stamps_path)
        # The token whose K/V each slot of the pool holds; None if never written.
        self._slots: list[int | None] = (
            [None] * (self.num_kv_blocks * self.block_size) if check_plans else [])

    def execute(self, plan: SchedulerOutput) -> list[SampledToken]:
        self.launch(plan)
        return self.collect()

    def launch(self, plan: SchedulerOutput) -> None:
        """Start the simulated device on plan: the tokens are made now, and collect() hands
        them out once the device time has passed (the engine works in between, as it does
        beside a GPU's forward)."""
        t0 = time.perf_counter()
        # A follower's rows: their one token is the one the last launch sampled for them,
        # taken here as a device would take it (and counted as their last output token).
        pending: list[int] | None = None  # per chunk: 1 where its token was pending
        if plan.prev_rows is None:
            # The engine queues only a follower behind a launch: an ordinary plan comes
            # when it collects nothing more, so what is left was given up (a collect failed).
            self._launched.clear()
        else:
            pending, last = [], self._last_sampled
            for chunk, row in zip(plan.chunks, plan.prev_rows, strict=True):
                pending.append(row is not None)
                if row is not None:
                    chunk.token_ids = [last[row].token_id]
        if self.check_plans:
            self._check_plan(plan, pending)
            for chunk in plan.chunks:
                self._check_context(chunk)
                self._write(chunk)
        t1 = time.perf_counter()
        num_tokens = plan.num_tokens  # a sum over the chunks: once a step
        # The simulated device's time for the forward and its sampling: the tokens are
        # made within it, so a step takes forward_time_s, not forward_time_s plus the
        # fake's own bookkeeping (at 1,000 streams, 0.3 ms a step). It starts when the
        # device is free: now, or when the plan launched before this one ends.
        device_s = self.forward_time_s + self.per_token_time_s * num_tokens
        done_at = (max(t1, self._done_at) if self._launched else t1) + device_s
        stamped: list[tuple[int, int]] | None = None if self._stamps is None else []
        sampled = self._last_sampled = self._sample_all(plan.chunks, stamped, pending)
        if stamped is not None:
            # The tokens count as made when the device time ends (a late wake-up from the
            # wait counts as added latency, not as the fake's).
            made_at = time.monotonic() + max(0.0, done_at - time.perf_counter())
            self._stamps.append((made_at, stamped))
        t2 = time.perf_counter()
        self._done_at = done_at
        self.num_steps += 1
        self.num_computed_tokens += num_tokens
        timing = StepTiming(
            prepare_s=t1 - t0,
            sample_s=t2 - t1,
            num_tokens=num_tokens,
            num_seqs=len(plan.chunks),
        )
        self._launched.append((done_at, sampled, timing))

    def collect(self) -> list[SampledToken]:
        """The oldest launched plan's tokens, once its device time is over."""
        done_at, sampled, timing = self._launched.popleft()
        t0 = time.perf_counter()
        if done_at > t0:
            time.sleep(done_at - t0)
        timing.forward_s = time.perf_counter() - t0  # the rest of the device time
        self.last_timing = timing
        return sampled

    def _write_stamps(self, path: str) -> None:
        """[first prompt token, output index, monotonic time made] for every token."""
        with open(path, "w") as f:
            json.dump([(first, index, made_at) for made_at, stamped in self._stamps
                       for first, index in stamped], f)

    def next_token(self, chunk: ScheduledChunk, num_pending: int = 0) -> int:
        """The token sampled after chunk: a function of its last token, position and seed.
        `num_pending`: 1 for a follower's row whose token was pending (not in its outputs
        yet)."""
        num_output = len(chunk.output_token_ids) + num_pending
        if self.eos_after is not None and num_output == self.eos_after:
            return EOS_TOKEN_ID
        if self.copy_context:
            known = chunk.prompt_token_ids + chunk.output_token_ids + \
                chunk.token_ids[len(chunk.token_ids) - num_pending:]
            last = known[-1]
            for j in range(len(known) - 2, -1, -1):
                if known[j] == last:
                    return known[j + 1]
        seed = self.config.seed + (chunk.params.seed or 0)
        return _token_after(chunk.token_ids[-1], chunk.context_len - 1, seed)

    # ---- internals ----------------------------------------------------------------------------

    def _sample_drafted(self, chunk: ScheduledChunk) -> SampledToken:
        """A chunk with drafts: a token at each of its rows (row i as if drafts[:i] were
        outputs already), then the drafts kept as worker/verify.py keeps them."""
        rows, counts = verify.expand([chunk])
        sampled = []
        for i, row in enumerate(rows):
            # The row's own view: its token is the chunk's i-th, at position start_pos + i.
            row.token_ids = chunk.token_ids[:i + 1]
            row.start_pos = chunk.start_pos
            sampled.append(self._sample(row))
        return verify.accept([chunk], counts, sampled)[0]

    def _sample_all(self, chunks: list[ScheduledChunk],
                    stamped: list[tuple[int, int]] | None = None,
                    pending: list[int] | None = None) -> list[SampledToken]:
        """_sample (or _sample_drafted) for every chunk that samples; each one's (first
        prompt token, output index) added to `stamped` when given. Plain chunks (no drafts,
        no logprobs, no forced EOS: a benchmark's 1,000 decode streams) take an inlined
        next_token: this one loop runs once a step per stream, beside a forward that is only
        a sleep. `pending`: a follower's, per chunk 1 where its token was pending (see
        next_token)."""
        if pending is None:
            pending = [0] * len(chunks)
        if self.eos_after is not None or self.copy_context:
            if stamped is not None:
                stamped += [(c.prompt_token_ids[0], len(c.output_token_ids) + n)
                            for c, n in zip(chunks, pending, strict=True)
                            if c.do_sample and c.prompt_token_ids]
            return [self._sample_drafted(chunk) if chunk.draft_token_ids else
                    self._sample(chunk, n) for chunk, n in zip(chunks, pending, strict=True)
                    if chunk.do_sample]
        base_seed = self.config.seed
        sampled = []
        for chunk, num_pending in zip(chunks, pending, strict=True):
            if not chunk.do_sample:
                continue
            if stamped is not None and chunk.prompt_token_ids:
                stamped.append((chunk.prompt_token_ids[0],
                                len(chunk.output_token_ids) + num_pending))
            params = chunk.params
            if chunk.draft_token_ids:
                sampled.append(self._sample_drafted(chunk))
                continue
            if params.logprobs is not None:
                sampled.append(self._sample(chunk, num_pending))
                continue
            # _token_after, inline.
            token_ids = chunk.token_ids
            token = (token_ids[-1] * 7919 + (chunk.start_pos + len(token_ids) - 1) * 104729
                     + (base_seed + (params.seed or 0)) * 31 + 17) % VOCAB_SIZE
            sampled.append(SampledToken(chunk.request_id,
                                        token + 1 if token == EOS_TOKEN_ID else token))
        return sampled

    def _sample(self, chunk: ScheduledChunk, num_pending: int = 0) -> SampledToken:
        token = self.next_token(chunk, num_pending)
        num_logprobs = chunk.params.logprobs
        if num_logprobs is None:
            return SampledToken(chunk.request_id, token)
        top = [(token, -0.25)] + [
            ((token + i) % VOCAB_SIZE, -1.0 - i) for i in range(1, num_logprobs)
        ]
        return SampledToken(chunk.request_id, token, logprob=-0.25, top_logprobs=top[:num_logprobs])

    def _check_plan(self, plan: SchedulerOutput, pending: list[int] | None = None) -> None:
        config = self.config
        _require(
            len(plan.chunks) <= config.max_num_seqs, f"{len(plan.chunks)} chunks > max_num_seqs"
        )
        if config.batching_mode is BatchingMode.CONTINUOUS:
            _require(
                plan.num_tokens <= config.max_num_batched_tokens,
                f"{plan.num_tokens} tokens > max_num_batched_tokens",
            )
        request_ids = [chunk.request_id for chunk in plan.chunks]
        _require(len(set(request_ids)) == len(request_ids), "a request appears twice in a plan")
        written: dict[int, str] = {}
        for k, chunk in enumerate(plan.chunks):
            self._check_chunk(chunk, 0 if pending is None else pending[k])
            first = chunk.start_pos // self.block_size
            last = (chunk.context_len - 1) // self.block_size
            for block_id in chunk.block_table[first : last + 1]:
                _require(block_id not in written, f"block {block_id} written by two chunks")
                written[block_id] = chunk.request_id
        for chunk in plan.chunks:
            for block_id in chunk.block_table:
                owner = written.get(block_id, chunk.request_id)
                _require(
                    owner == chunk.request_id,
                    f"{chunk.request_id} reads block {block_id} that {owner} writes",
                )

    def _check_chunk(self, chunk: ScheduledChunk, num_pending: int = 0) -> None:
        rid = chunk.request_id
        # A follower's row: its token (taken from the last launch) is its pending output.
        drafts = chunk.draft_token_ids or chunk.token_ids[len(chunk.token_ids) - num_pending:]
        num_known = len(chunk.prompt_token_ids) + len(chunk.output_token_ids) + len(drafts)
        _require(len(chunk.token_ids) > 0, f"{rid}: empty chunk")
        _require(0 <= chunk.start_pos and chunk.context_len <= num_known, f"{rid}: bad positions")
        _require(
            chunk.context_len <= self.info.max_model_len, f"{rid}: context beyond max_model_len"
        )
        _require(
            len(chunk.block_table) * self.block_size >= chunk.context_len,
            f"{rid}: block table too short for {chunk.context_len} tokens",
        )
        _require(
            all(0 <= b < self.num_kv_blocks for b in chunk.block_table), f"{rid}: bad block id"
        )
        _require(
            chunk.do_sample == (chunk.context_len == num_known),
            f"{rid}: do_sample must be set exactly when the chunk reaches the end",
        )
        known = chunk.prompt_token_ids + chunk.output_token_ids + drafts
        _require(
            chunk.token_ids == known[chunk.start_pos : chunk.context_len],
            f"{rid}: chunk tokens are not the sequence's tokens",
        )

    def _check_context(self, chunk: ScheduledChunk) -> None:
        """The K/V the chunk attends to must be this sequence's tokens at their positions."""
        known = chunk.prompt_token_ids + chunk.output_token_ids
        for position in range(chunk.start_pos):
            slot = self._slot(chunk, position)
            if self._slots[slot] != known[position]:
                raise InvalidPlanError(
                    f"{chunk.request_id}: position {position} of the cache holds "
                    f"{self._slots[slot]}, expected {known[position]}"
                )

    def _write(self, chunk: ScheduledChunk) -> None:
        for i, token in enumerate(chunk.token_ids):
            self._slots[self._slot(chunk, chunk.start_pos + i)] = token

    def _slot(self, chunk: ScheduledChunk, position: int) -> int:
        block_id = chunk.block_table[position // self.block_size]
        return block_id * self.block_size + position % self.block_size


def _token_after(last_token: int, position: int, seed: int) -> int:
    token = (last_token * 7919 + position * 104729 + seed * 31 + 17) % VOCAB_SIZE
    return token + 1 if token == EOS_TOKEN_ID else token


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidPlanError(message)
