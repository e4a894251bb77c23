"""Engine: the in-process API a worker wraps. One step = schedule, execute, update, emit."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import Protocol

from zeroserve.common.protocol import POISON_REQUEST
from zeroserve.worker.block_manager import BlockManager
from zeroserve.worker.config import EngineConfig
from zeroserve.worker.grammar import GrammarCompiler, GrammarError, GrammarSpec, GrammarState
from zeroserve.worker.grammar_pending import PendingGrammars
from zeroserve.worker.model.info import ModelInfo
from zeroserve.worker.outputs import EngineStats, RequestOutput, StepTiming
from zeroserve.worker.plan import SampledToken, SchedulerOutput
from zeroserve.worker.scheduler import Scheduler
from zeroserve.worker.sequence import (
    FinishReason,
    RequestError,
    SamplingParams,
    Sequence,
    SequenceStatus,
)
from zeroserve.worker.startup import StartupTimer, seconds_since_process_start

logger = logging.getLogger(__name__)


class StepFailed(Exception):
    """No request of a step ran, not even alone (worker/engine.py, Engine._isolate): the
    device, not a request, is at fault as far as anyone can tell. `request_ids`: the step's
    requests, still held by the engine (abort them to hand them to another worker)."""

    def __init__(self, request_ids: list[str], cause: Exception) -> None:
        super().__init__(f"no request of the step ran ({type(cause).__name__}: {cause})")
        self.request_ids = request_ids


# Finishes whose output is made when they happen (abort(), a failed batch), not by the step.
_REPORTED_AT_ONCE = (FinishReason.ABORT, FinishReason.ERROR)


class Runner(Protocol):
    info: ModelInfo
    num_kv_blocks: int  # the pool size the runner allocated
    block_size: int
    last_timing: StepTiming  # prepare_s, forward_s, sample_s of the last execute()

    def execute(self, plan: SchedulerOutput) -> list[SampledToken]:
        """One SampledToken per chunk with do_sample=True, in chunk order."""
        ...

    # Optional, for runners whose device computes while the CPU goes on: launch(plan)
    # starts the step and returns at once, collect() waits for it and returns what
    # execute(plan) would. The engine does the last step's output work in between.
    # A runner whose device queues launches (collect() hands each launched plan's tokens
    # out in order) and takes a plan's pending tokens from its own last samples
    # (SchedulerOutput.prev_rows) says so with `can_follow = True`: step_overlapped() then
    # launches the next step before the last one's tokens are collected.


# Engine._output makes one RequestOutput (a named tuple) per stream per step from a tuple of
# every field, with tuple.__new__ (its own __new__ is Python); the fields must stay in
# this order.
_OUTPUT_FIELDS = ("request_id", "new_token_ids", "finish_reason", "num_prompt_tokens",
                  "num_output_tokens", "num_cached_tokens", "logprobs", "prompt_logprobs",
                  "error", "timings", "error_code")
if RequestOutput._fields != _OUTPUT_FIELDS:
    raise TypeError("RequestOutput's fields changed: update Engine._output and _OUTPUT_FIELDS")
_new_output = tuple.__new__


class Engine:
    def __init__(self, config: EngineConfig, runner: Runner | None = None) -> None:
        timer = StartupTimer()
        boot_s = seconds_since_process_start()
        if boot_s is not None:
            timer.add("boot", boot_s)
        if runner is None:
            with timer.phase("import"):
                from zeroserve.worker.model_runner import (
                    ModelRunner,  # torch stays out of engine imports
                )

            runner = ModelRunner(config, timer)
        self.config = config
        self.runner = runner
        self.info: ModelInfo = runner.info
        self.block_manager = BlockManager(
            runner.num_kv_blocks, runner.block_size, config.enable_prefix_caching
        )
        # The box's KV tier (worker/kv_tier/), None when off; it imports torch.
        self.tier = None
        if config.kv_offloading_size:
            from zeroserve.worker.kv_tier.setup import attach

            self.tier = attach(config, runner, self.block_manager)
        # The longest sequence this worker can hold: the model's context, the configured cap,
        # and the KV pool (a sequence must fit the pool alone, or it could never finish).
        limits = [self.info.max_model_len, runner.num_kv_blocks * runner.block_size]
        if config.max_model_len is not None:
            limits.append(config.max_model_len)
        self.max_model_len = min(limits)
        self.scheduler = Scheduler(
            config, self.block_manager, self.max_model_len, self.info.eos_token_ids
        )
        self._pending: list[RequestOutput] = []  # finished between steps (aborts)
        # The last step's sequences with news, and its sampled tokens: their outputs are
        # built by take_outputs() (at once by step(), a step later by step_overlapped()).
        self._changed: list[Sequence] = []
        self._sampled: list[SampledToken] = []
        self._num_steps = 0
        self._last_step = StepTiming()
        # A plan launched behind the last step (Scheduler.follow), collected by the next.
        self._launched: SchedulerOutput | None = None
        self._can_follow = (bool(getattr(runner, "can_follow", False)) and self.tier is None
                            and hasattr(runner, "launch"))
        self._generate_ids = itertools.count()
        # Vocabulary and compiled-grammar cache for constrained decoding, made on first use.
        self.grammar_compiler: GrammarCompiler | None = None
        # Requests waiting for their grammar to compile off this thread (made on first use).
        self._grammars: PendingGrammars | None = None
        # Called from another thread when a request waiting for its grammar can go on: the
        # worker wakes its loop with it (None: whoever steps the engine polls).
        self.wake: Callable[[], None] | None = None
        # Seconds per start-up phase (worker/startup.py), for the log and the HELLO.
        total_s = seconds_since_process_start()
        if total_s is not None:
            timer.add("total", total_s)
        self.startup_phases: dict[str, float] = timer.rounded()
        logger.info("startup phases", extra={"startup_phases_s": self.startup_phases,
                                             **timer.notes})

    # ---- requests ---------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        output_token_ids: list[int] | tuple[int, ...] = (),
        grammar: GrammarSpec | None = None, priority: int = 0, flow: int = 0,
    ) -> None:
        """Queue a request. Raises RequestError (user-facing message) if it can never run.
        `priority`: lower is admitted first and preempted last (worker/priority_policy.py);
        `flow`: the client, hashed (0: none), whose share of a full batch's slots it counts in.

        `output_token_ids`: tokens this request already produced elsewhere (a stream moved
        from a lost worker). They count as its own outputs (max_tokens, penalties, the
        sampling seed's position), are prefilled with the prompt, and are not emitted again.
        """
        vocab_size = self.info.vocab_size
        if any(not 0 <= t < vocab_size for t in (*prompt_token_ids, *output_token_ids)):
            raise RequestError(f"Token ids must be in [0, {vocab_size}).")
        if len(output_token_ids) >= params.max_tokens:
            raise RequestError("The request has produced all of its max_tokens already.")
        seq = Sequence(request_id, list(prompt_token_ids), params,
                       output_token_ids=list(output_token_ids),
                       num_emitted_tokens=len(output_token_ids), priority=priority,
                       flow=flow)
        if grammar is not None:  # its matcher resumes over output_token_ids at the first mask
            state = self._cached_grammar(seq, grammar)
            if state is None:  # compiling off this thread: it waits, unscheduled
                self._pending_grammars().add(seq, grammar)
                return
            seq.params = dataclasses.replace(params, grammar=state)
        self.scheduler.add(seq)

    def _cached_grammar(self, seq: Sequence, spec: GrammarSpec) -> GrammarState | None:
        """A state for `seq`'s grammar if it is compiled already, else None (compile it).
        Raises RequestError for what the scheduler would refuse, or no vocabulary."""
        if self.scheduler.get(seq.request_id) is not None or (
                self._grammars is not None and seq.request_id in self._grammars):
            raise RequestError(f"Request id {seq.request_id!r} is already in use.")
        self.scheduler.check_request(seq.num_prompt_tokens, seq.params.max_tokens)
        if self.grammar_compiler is None:
            self.grammar_compiler = GrammarCompiler(self.info.path, self.info.vocab_size,
                                                    self.info.eos_token_ids)
        try:
            self.grammar_compiler.check_vocabulary()
        except GrammarError as e:
            raise RequestError(str(e)) from None
        template = self.grammar_compiler.cached(spec)
        return None if template is None else GrammarState(spec, template.deep_copy())

    def _pending_grammars(self) -> PendingGrammars:
        if self._grammars is None:
            assert self.grammar_compiler is not None
            self._grammars = PendingGrammars(self.grammar_compiler, self._on_grammar_compiled)
        return self._grammars

    def _on_grammar_compiled(self) -> None:
        wake = self.wake
        if wake is not None:
            wake()

    def _admit_grammars(self) -> None:
        """Requests whose grammar compiled join the scheduler; those whose grammar did not
        compile fail with its error (a typed RequestOutput, as an invalid request would)."""
        assert self._grammars is not None
        for seq, state, error, is_paused in self._grammars.take_ready():
            if state is not None:
                seq.params = dataclasses.replace(seq.params, grammar=state)
                try:
                    self.scheduler.add(seq)
                    if is_paused:  # out of credit: it waits for CREDIT, not for a slot
                        self.scheduler.pause(seq.request_id)
                    continue
                except RequestError as e:
                    error = e
            message = str(error) if isinstance(error, (GrammarError, RequestError)) else \
                f"internal error compiling the grammar: {error}"
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ERROR
            self._pending.append(self._output(seq, None, message))

    def abort(self, request_id: str) -> bool:
        """Finish a request now, freeing its KV blocks; it is reported once by the next step.

        One that finished in the last step, its finish not handed out yet, counts as aborted
        too: that finish is its one report (False only when nothing of it is still to come),
        so a new request of the same id never takes it for its own."""
        seq = self.scheduler.abort(request_id)
        if seq is None and self._grammars is not None:
            seq = self._grammars.abort(request_id)  # still compiling: nothing else to free
            if seq is not None:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
        if seq is None:
            return self._take_held_finish(request_id)
        self._pending.append(self._output(seq, None))
        return True

    def _take_held_finish(self, request_id: str) -> bool:
        """Move the held output of a request that finished in the last step to the aborts'."""
        for k, seq in enumerate(self._changed):
            if seq.request_id == request_id and seq.is_finished:
                if seq.finish_reason in _REPORTED_AT_ONCE:
                    return False  # reported already, with its abort or failure
                del self._changed[k]
                self._pending += self._outputs([seq], self._sampled)
                return True
        return False

    def pause(self, request_id: str) -> bool:
        """Leave the batch but keep the KV blocks (a stream out of credit). A request still
        compiling its grammar joins the scheduler paused. False: no such request."""
        if self.scheduler.pause(request_id):
            return True
        return self._grammars is not None and self._grammars.pause(request_id)

    def resume(self, request_id: str) -> bool:
        if self.scheduler.resume(request_id):
            return True
        return self._grammars is not None and self._grammars.resume(request_id)

    def set_credit_limit(self, request_id: str, limit: int) -> None:
        """The output tokens (in all) a stream may have before it pauses: speculative drafts
        never run past it."""
        seq = self.scheduler.get(request_id)
        if seq is None and self._grammars is not None:
            seq = self._grammars.get(request_id)  # still compiling its grammar
        if seq is not None:
            seq.credit_limit = limit

    def has_admissions(self) -> bool:
        """Requests whose grammar compiled, for the next step to admit: it must run even
        when every stream is paused (a paused one joins the scheduler paused)."""
        return self._grammars is not None and self._grammars.has_ready()

    def has_unfinished(self) -> bool:
        """Something for the next step to do. A request whose grammar is still compiling
        is not (`wake` tells when it is)."""
        return (self.scheduler.has_unfinished() or bool(self._pending) or bool(self._changed)
                or (self._grammars is not None and self._grammars.has_ready())
                or self._launched is not None)

    def has_launched_step(self) -> bool:
        """A step is computing that the next step collects (it must come, paused or not)."""
        return self._launched is not None

    # ---- the loop ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step; its outputs (and those of aborts since the last step) are returned."""
        self._run_step(None)
        return self.take_outputs()

    def step_overlapped(self, emit: Callable[[list[RequestOutput]], None]) -> None:
        """One step whose outputs are handed to `emit` during the next step's device time.

        The worker's loop runs this (async output processing): after the next plan is
        launched, the previous step's outputs are built and emitted while the device computes,
        so a step's serial CPU work is only scheduling and the state update. If the next plan
        is empty (nothing to overlap with), they are emitted at once; when the caller stops
        stepping, take_outputs() hands out what is left. A stream paused from `emit` (out of
        credit) while it is in the launched plan loses that step's token, which it computes
        again when resumed, so it never gets ahead of its credit.

        With a runner that can follow, the next step is planned and launched behind this one
        before this one's tokens are known, where that plan is exact (Scheduler.follow): the
        update then runs during the device time too, and the next call collects that step
        (has_launched_step()) instead of planning one.
        """
        self._run_step(emit)

    def take_outputs(self) -> list[RequestOutput]:
        """The last step's outputs not handed out yet, and those of aborts since (an aborted
        request's news come once, with its abort)."""
        outputs = self._pending
        self._pending = []
        changed, sampled = self._changed, self._sampled
        if changed:
            self._changed, self._sampled = [], []
            outputs += self._outputs(changed, sampled)
        return outputs

    def _run_step(self, emit: Callable[[list[RequestOutput]], None] | None) -> None:
        t0 = time.perf_counter()
        if self._grammars is not None:
            self._admit_grammars()
        runner = self.runner
        launch = getattr(runner, "launch", None)
        sampled = None
        is_emitted = False
        plan, self._launched = self._launched, None
        if plan is None:
            plan = self.scheduler.schedule()
            t1 = time.perf_counter()
            if plan.is_empty:
                if emit is not None:
                    emit(self.take_outputs())
                self._last_step = StepTiming()
                return
            try:
                if launch is not None:
                    launch(plan)  # the device computes from here until collect() returns
            except Exception as exc:
                sampled = self._isolate(plan, exc)
        else:  # planned and launched behind the last step (Scheduler.follow)
            t1 = time.perf_counter()
            if emit is None:
                if self._changed:  # step() after step_overlapped(): keep its news
                    self._pending = self.take_outputs()
            else:
                # The device has a step in hand, so the last step's outputs go out first
                # (sooner, and a stream they pause gets no row in the next follower).
                self._emit_or_collect(emit)
                is_emitted = True
        follower = self._launch_follower() if sampled is None and emit is not None else None
        try:
            if emit is not None and not is_emitted:
                emit(self.take_outputs())
            if sampled is None:
                try:
                    sampled = runner.collect() if launch is not None else runner.execute(plan)
                except Exception as exc:
                    if follower is not None:  # it took this plan's tokens: drop it unrun
                        self._drop_follower(1)
                        follower = None
                    sampled = self._isolate(plan, exc)
                else:
                    self._take_runner_prompt_logprobs()
            runner_timing = runner.last_timing
            t2 = time.perf_counter()
            self._changed = self.scheduler.update(plan, sampled)
        except BaseException:
            if follower is not None:  # nothing would collect it, nor update the plan before
                self._drop_follower(2 if sampled is None else 1)
            raise
        self._sampled = sampled
        self._launched = follower
        if self.tier is not None:
            self.tier.flush()  # blocks filled this step, before the next may reuse them
        t3 = time.perf_counter()
        self._num_steps += 1
        self._last_step = StepTiming(
            schedule_s=t1 - t0,
            prepare_s=runner_timing.prepare_s,
            forward_s=runner_timing.forward_s,
            sample_s=runner_timing.sample_s,
            update_s=t3 - t2,
            num_tokens=plan.num_tokens,
            num_seqs=len(plan.chunks),
        )

    def _launch_follower(self) -> SchedulerOutput | None:
        """Plan and launch the next step behind the one computing, where it can be exact."""
        if not self._can_follow:
            return None
        follower = self.scheduler.follow()
        if follower is not None:
            try:
                self.runner.launch(follower)
            except Exception:
                logger.exception("launching a step behind the last one failed; its rows "
                                 "run in the next step")
                self.scheduler.drop_follower()
                return None
        return follower

    def _emit_or_collect(self, emit: Callable[[list[RequestOutput]], None]) -> None:
        """Emit the last step's outputs while a launched step computes; if that raises, the
        step is collected (and dropped) first: nothing else would."""
        try:
            emit(self.take_outputs())
        except BaseException:
            self._collect_quietly(1)
            raise

    def _drop_follower(self, num_launched: int) -> None:
        """The step behind a failed one: forgotten, and the runner's `num_launched` plans
        not collected yet (it and maybe the failed one) collected (its rows run again)."""
        self.scheduler.drop_follower()
        self._collect_quietly(num_launched)

    def _collect_quietly(self, num_launched: int) -> None:
        """Collect and drop what a failed step leaves launched: a runner that queues
        launches gets an ordinary plan only when it holds nothing more."""
        for _ in range(num_launched):
            try:
                self.runner.collect()
            except Exception:
                logger.exception("collecting the steps of a failed one failed too")

    @property
    def last_step(self) -> StepTiming:
        return self._last_step

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + len(self._grammars or ()),
            num_paused=len(scheduler.paused),
            num_free_blocks=self.block_manager.num_free_blocks,
            num_cached_blocks=self.block_manager.num_cached_blocks,
            num_total_blocks=self.block_manager.num_total_blocks,
            num_preemptions=scheduler.num_preemptions,
            num_prefix_queries=self.block_manager.num_prefix_queries,
            num_prefix_hits=self.block_manager.num_prefix_hits,
            num_steps=self._num_steps,
            last_step=self._last_step,
            spec_decode=scheduler.spec_stats,
            kv_tier=None if self.tier is None else self.tier.counters,
        )

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
    ) -> list[list[int]]:
        """Run prompts to completion (alongside anything already queued); their output ids."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        batch = next(self._generate_ids)
        request_ids = [f"generate-{batch}-{i}" for i in range(len(prompts))]
        try:
            for request_id, prompt, p in zip(request_ids, prompts, params, strict=True):
                self.add_request(request_id, prompt, p)
        except RequestError:
            for request_id in request_ids:
                self.abort(request_id)
            raise
        results: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
        num_left = len(request_ids)
        while num_left:
            for output in self.step():
                tokens = results.get(output.request_id)
                if tokens is None:
                    continue
                tokens.extend(output.new_token_ids)
                num_left -= output.is_finished
            if self._last_step.num_seqs == 0:
                time.sleep(0.0005)  # dynamic batching gathering arrivals: nothing to run yet
        return [results[request_id] for request_id in request_ids]

    # ---- outputs ---------------------------------------------------------------------------------

    def _outputs(self, changed: list[Sequence], sampled: list[SampledToken]) -> list[RequestOutput]:
        by_id: dict[str, SampledToken] | None = None
        outputs = []
        for seq in changed:
            reason = seq.finish_reason
            if reason is not None and reason in _REPORTED_AT_ONCE:
                continue  # aborted or failed since the step: reported then, with its tokens
            if (seq.first_token_time is not None and seq.params.logprobs is None
                    and seq.prompt_logprobs is None):
                # Most outputs (every stream every step): its new tokens and counts, as
                # _output makes them, without the call.
                output_token_ids = seq.output_token_ids
                num_output_tokens = len(output_token_ids)
                new_token_ids = output_token_ids[seq.num_emitted_tokens:]
                seq.num_emitted_tokens = num_output_tokens
                outputs.append(_new_output(RequestOutput, (
                    seq.request_id, new_token_ids, reason, len(seq.prompt_token_ids),
                    num_output_tokens, seq.num_cached_tokens, None, None, None, None, None)))
                continue
            token = None
            if seq.params.logprobs is not None:
                if by_id is None:
                    by_id = {s.request_id: s for s in sampled}
                token = by_id.get(seq.request_id)
            outputs.append(self._output(seq, token))
        return outputs

    def _output(
        self, seq: Sequence, token: SampledToken | None, error: str | None = None,
        error_code: str | None = None,
    ) -> RequestOutput:
        # Once per stream per step: plain attribute reads, no properties.
        output_token_ids = seq.output_token_ids
        num_output_tokens = len(output_token_ids)
        new_token_ids = output_token_ids[seq.num_emitted_tokens :]
        seq.num_emitted_tokens = num_output_tokens
        timings = None
        if (seq.first_token_time is None and new_token_ids
                and seq.first_scheduled_time is not None):
            seq.first_token_time = now = self.scheduler.clock()
            timings = (max(0.0, seq.first_scheduled_time - seq.arrival_time),
                       max(0.0, now - seq.first_scheduled_time))
        logprobs = None
        if token is not None and token.logprob is not None and new_token_ids:
            logprobs = [(token.logprob, list(token.top_logprobs or []))]
            if token.accepted_logprobs:  # accepted drafts first; a stop may cut them short
                logprobs = (token.accepted_logprobs + logprobs)[:len(new_token_ids)]
        prompt_logprobs = None
        if seq.prompt_logprobs is not None and not seq.is_prompt_logprobs_sent and (
                new_token_ids or seq.finish_reason is not None):
            prompt_logprobs, seq.is_prompt_logprobs_sent = seq.prompt_logprobs, True
        return _new_output(RequestOutput, (
            seq.request_id, new_token_ids, seq.finish_reason, len(seq.prompt_token_ids),
            num_output_tokens, seq.num_cached_tokens, logprobs, prompt_logprobs, error, timings,
            error_code))

    def _take_prompt_logprobs(self, computed: dict[str, tuple[int, list]]) -> None:
        """Append what the runner computed to each sequence's prompt logprobs, in order (a
        recompute after preemption repeats positions it already has)."""
        for request_id, (first, entries) in computed.items():
            seq = self.scheduler.get(request_id)
            if seq is None:
                continue
            have = seq.prompt_logprobs if seq.prompt_logprobs is not None else []
            if first <= len(have) + 1 < first + len(entries):
                have += entries[len(have) + 1 - first:]
            seq.prompt_logprobs = have

    def _take_runner_prompt_logprobs(self) -> None:
        prompt_logprobs = getattr(self.runner, "last_prompt_logprobs", None)
        if prompt_logprobs:  # before update(): a request may finish in this step
            self._take_prompt_logprobs(prompt_logprobs)

    def _isolate(self, plan: SchedulerOutput, exc: Exception) -> list[SampledToken]:
        """The runner failed on a batch: run each of its chunks alone, so that only a request
        that fails by itself while others run (the poison) fails, with ERROR and the code
        "poison_request" (the gateway does not move it to another worker, where it would
        fail that batch); the others' tokens stand as the batch's would have. Returns the
        batch's sampled tokens for update().

        Where nothing runs, not even alone, nothing tells a poison request from a device that
        failed (a request alone in its batch included): StepFailed is raised, naming the
        step's requests, which stay as they were for the caller to hand back (another worker
        may run them) and to count the failed step (a worker whose steps all fail exits)."""
        logger.warning("runner failed on a batch of %d sequences (%s: %s); running them one "
                       "by one", len(plan.chunks), type(exc).__name__, exc)
        sampled: list[SampledToken] = []
        failed: list[tuple[str, Exception]] = []
        for chunk in plan.chunks:
            try:
                tokens = self.runner.execute(SchedulerOutput([chunk]))
            except Exception as alone_exc:
                logger.exception("request %s fails alone", chunk.request_id)
                failed.append((chunk.request_id, alone_exc))
                if chunk.do_sample:  # a stand-in: update() skips a finished sequence
                    sampled.append(SampledToken(chunk.request_id, 0))
                continue
            self._take_runner_prompt_logprobs()
            sampled += tokens
        if len(failed) == len(plan.chunks):
            raise StepFailed([chunk.request_id for chunk in plan.chunks], exc) from exc
        for request_id, alone_exc in failed:
            seq = self.scheduler.finish_with_error(request_id)
            if seq is not None:
                self._pending.append(self._output(
                    seq, None, "The worker failed to run this request: "
                               f"{type(alone_exc).__name__}", POISON_REQUEST))
        return sampled
