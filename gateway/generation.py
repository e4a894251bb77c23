"""From worker token batches to client text: one `Choice` per engine request, grouped per
HTTP request in a `RequestGroup`.

A choice runs each batch through the incremental detokenizer, then the stop-string
matcher; a stop string ends the choice here and aborts it in the worker. The group owns
the engine requests of one HTTP request (n choices x prompts), submits them, yields
updates in arrival order, and on close ends whatever is still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from zeroserve.common.protocol import TokenOutput
from zeroserve.gateway.core import Gateway
from zeroserve.gateway.errors import APIError, server_error, worker_failed
from zeroserve.gateway.observability.metrics import RequestMetrics
from zeroserve.gateway.streams import RequestState, Sink
from zeroserve.gateway.text.detokenizer import IncrementalDetokenizer
from zeroserve.gateway.text.reasoning import ReasoningParser
from zeroserve.gateway.text.stop_strings import StopStringMatcher
from zeroserve.gateway.text.tokenizer import TextTokenizer


@dataclass(slots=True)
class ChoiceUpdate:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list | None  # the worker's entries for token_ids: [logprob, [[id, lp], ...]]
    finish_reason: str | None
    prompt_logprobs: list | None = None  # once: entries for the prompt's tokens after the first
    # A reasoning model's thinking (text/reasoning.py), split from `text`, which then holds
    # only the answer; "" when the request has no reasoning parser.
    reasoning: str = ""


@dataclass
class Choice:
    index: int
    state: RequestState
    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    num_prompt_tokens: int
    # echo with max_tokens 0: the worker makes one token (it cannot make none) for the
    # prompt's logprobs; that token is dropped and the choice ends "length" with none.
    is_scoring: bool = False
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    # Gateway clock, for metrics and traces: when the request arrived, was first sent to a
    # worker, got its first and its last output.
    created_at: float = 0.0
    submitted_at: float = 0.0
    first_output_at: float = 0.0
    last_output_at: float = 0.0
    # Phases, from the worker's timings where it sent them (0 until the first token).
    queue_s: float = 0.0
    prefill_s: float = 0.0
    # Chat-style requests of a reasoning model: splits the thinking from the answer.
    reasoning: ReasoningParser | None = None
    num_reasoning_tokens: int = 0
    _num_undecided: int = 0  # tokens held while the output might still open <think>
    # No stop strings and no reasoning parser: until its finish, an output's text is the
    # detokenizer's (consume's short way, taken once per stream per engine step).
    is_plain: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.is_plain = not self.stop.stops and self.reasoning is None

    def consume(self, out: TokenOutput, metrics: RequestMetrics, now: float) -> ChoiceUpdate:
        """One batch from the worker -> text to emit (maybe "") and maybe a finish."""
        if self.is_scoring:
            return self._scored(out, metrics, now)
        token_ids = out.new_token_ids
        num_new = len(token_ids)
        if num_new:
            # Per chunk, the metrics cost one list append (RequestGroup counts the tokens).
            if self.num_output_tokens:
                metrics.record_gap(now - self.last_output_at)
            else:
                self._on_first_output(out.timings, metrics, now)
            self.last_output_at = now
        self.num_cached_tokens = out.num_cached_tokens
        if self.is_plain and out.finish_reason is None:
            self.num_output_tokens += num_new
            return ChoiceUpdate(self.index, self.detokenizer.push(token_ids), token_ids,
                                out.logprobs, None, out.prompt_logprobs)
        if out.finish_reason in ("abort", "error"):
            self.num_output_tokens += num_new
            detail = out.error or "the worker aborted the request"
            raise (server_error if out.finish_reason == "error" else worker_failed)(
                f"Generation failed: {detail}")
        logprobs = out.logprobs
        if num_new > 1 and self.stop.stops:
            text, num_used = self._push_until_stop(token_ids)
            if num_used < num_new:  # the tokens after the stop are not the choice's
                token_ids, num_new = token_ids[:num_used], num_used
                logprobs = None if logprobs is None else logprobs[:num_used]
        else:
            text = self.stop.push(self.detokenizer.push(token_ids))
        self.num_output_tokens += num_new
        if not self.stop.is_stopped and out.finish_reason is not None:
            text += self.stop.push(self.detokenizer.flush())
            text += self.stop.flush()
        if self.stop.is_stopped:
            self.finish_reason = "stop"
        elif out.finish_reason is not None:
            self.finish_reason = out.finish_reason
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self._split_reasoning(text, num_new)
        if self.finish_reason is not None:
            has_output = self.has_output
            metrics.on_finished(self.finish_reason, self.num_output_tokens,
                                now - self.created_at,
                                self.prefill_s if has_output else None,
                                now - self.first_output_at if has_output else None)
        return ChoiceUpdate(self.index, text, token_ids, logprobs,
                            self.finish_reason, out.prompt_logprobs, reasoning)

    def _push_until_stop(self, token_ids: list[int]) -> tuple[str, int]:
        """Several tokens at once (accepted speculative drafts): one at a time, as they would
        come without speculation, up to the one that completes a stop string. The text and
        how many tokens the choice keeps: usage, billing and logprobs count none after the
        stop, as for the same request decoded token by token."""
        text = ""
        for k, token_id in enumerate(token_ids):
            text += self.stop.push(self.detokenizer.push([token_id]))
            if self.stop.is_stopped:
                return text, k + 1
        return text, len(token_ids)

    def _split_reasoning(self, text: str, num_new: int) -> tuple[str, str]:
        """(reasoning, answer) of this update's text. Its tokens count as reasoning while
        the thinking is open at their start (the close tag's tokens included), and so do
        those that opened it."""
        parser = self.reasoning
        was_reasoning = parser.is_reasoning
        reasoning, answer = parser.push(text)
        if self.finish_reason is not None:
            more_reasoning, more_answer = parser.flush()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        if was_reasoning:
            self.num_reasoning_tokens += num_new
        elif parser.is_reasoning:  # this update opened it, maybe after held tokens
            self.num_reasoning_tokens += self._num_undecided + num_new
        self._num_undecided = 0 if answer or parser.is_reasoning else \
            self._num_undecided + num_new
        return reasoning, answer

    def _scored(self, out: TokenOutput, metrics: RequestMetrics, now: float) -> ChoiceUpdate:
        """A scoring choice's first output ends it: the prompt was computed."""
        if out.finish_reason in ("abort", "error"):
            detail = out.error or "the worker aborted the request"
            raise (server_error if out.finish_reason == "error" else worker_failed)(
                f"Generation failed: {detail}")
        self._on_first_output(out.timings, metrics, now)
        self.num_cached_tokens = out.num_cached_tokens
        self.finish_reason = "length"
        metrics.on_finished("length", 0, now - self.created_at, self.prefill_s, 0.0)
        return ChoiceUpdate(self.index, "", [], None, "length", out.prompt_logprobs)

    @property
    def has_output(self) -> bool:
        return self.first_output_at > 0

    def _on_first_output(self, timings: list | None, metrics: RequestMetrics,
                         now: float) -> None:
        """Split the wait for the first token into queue and prefill: the gateway's queue
        (arrival to the first SUBMIT) plus the worker's, then the worker's prefill. A worker
        that sent no timings leaves everything after the SUBMIT to the prefill."""
        self.first_output_at = now
        submitted_at = self.submitted_at or now
        worker_queue_s, prefill_s = timings if timings else (0.0, now - submitted_at)
        self.queue_s = max(0.0, submitted_at - self.created_at) + worker_queue_s
        self.prefill_s = prefill_s
        metrics.on_first_token(now - self.created_at, self.queue_s, self.prefill_s)


@dataclass
class RequestGroup:
    gateway: Gateway
    choices: list[Choice] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)  # per prompt, once
    sink: Sink = field(default_factory=Sink)
    # echo + logprobs: each prompt's logprobs were computed (an extra pass over the prompt).
    has_prompt_logprobs: bool = False
    # The HTTP request's W3C trace-context headers, for the traces' parent (with tracing on).
    trace_headers: dict[str, str] | None = None
    _params: list[dict] = field(default_factory=list)

    def add(self, prompt_ids: list[int], params: dict, tokenizer: TextTokenizer,
            stop: tuple[str, ...], skip_special_tokens: bool, is_scoring: bool = False,
            reasoning: ReasoningParser | None = None, cache_key: str | None = None) -> None:
        index = len(self.choices)
        state = self.gateway.new_request(index, prompt_ids, self.sink)
        state.cache_key = cache_key
        detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.choices.append(Choice(index, state, detok, StopStringMatcher(list(stop)),
                                   len(prompt_ids), is_scoring,
                                   created_at=self.gateway.clock(), reasoning=reasoning))
        self._params.append(params)

    def submit_now(self) -> bool:
        """Admit and send the request at once, with no task and no wait, when it is one
        choice that a worker can take now (nobody queued ahead): True. False: nothing was
        sent; `submit` admits it (it may wait). On a failure (503 while shutting down) it
        raises and ends the choice."""
        if len(self.choices) != 1:
            return False
        choice = self.choices[0]
        try:
            if not self.gateway.submit_now(choice.state, self._params[0]):
                return False
        except BaseException:
            self.close()
            raise
        self._on_submitted()
        return True

    async def submit(self) -> None:
        """Admit and send every choice; on any failure (429, 503) raise and end them all."""
        self.gateway.admission.check_room(len(self.choices), self.choices[0].state.ticket)
        tasks = [asyncio.ensure_future(self.gateway.submit(c.state, p))
                 for c, p in zip(self.choices, self._params, strict=True)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.close()
            raise
        self._on_submitted()

    def _on_submitted(self) -> None:
        for c in self.choices:
            if c.state.num_submits:  # else it ended while it waited
                c.submitted_at = c.state.submitted_at
                self.gateway.metrics.on_admitted(c.num_prompt_tokens)

    @property
    def is_finished(self) -> bool:
        for choice in self.choices:  # (a loop: all() with a generator costs 3x, per output)
            if choice.finish_reason is None:
                return False
        return True

    async def update_batches(self, is_stopped: Callable[[], bool] = lambda: False
                             ) -> AsyncIterator[list[tuple[ChoiceUpdate, RequestState]]]:
        """Updates in arrival order, batched: everything already queued comes together, so a
        backlogged stream costs one client write per batch, not per token. Ends when every
        choice finished, or when `is_stopped()` says so after a wake-up; raises APIError
        when a choice fails (worker lost, worker error), after yielding what came before the
        failure. The caller grants credit for the tokens of each update once it has
        delivered them."""
        while not self.is_finished and not is_stopped():
            batch, error = self.take(await self.sink.get_batch())
            if batch:
                yield batch
            if error is not None:
                raise error

    def take(self, items: list[tuple[RequestState, TokenOutput | APIError]]
             ) -> tuple[list[tuple[ChoiceUpdate, RequestState]], APIError | None]:
        """Sink items -> the updates they make, in order, and the failure that stopped them
        (what follows a failure is dropped: the group ends with it)."""
        batch: list[tuple[ChoiceUpdate, RequestState]] = []
        now = self.gateway.clock()
        num_tokens = 0
        for state, item in items:
            try:
                update = self._update(state, item, now)
            except APIError as e:
                return batch, e
            if update is not None:
                batch.append((update, state))
                num_tokens += len(update.token_ids)
        if batch:
            self.gateway.metrics.on_tokens(num_tokens)
        return batch, None

    def take_one(self, state: RequestState, out: TokenOutput) -> ChoiceUpdate | None:
        """`take` of one worker output, the direct path's case (one per stream per engine
        step): its update (None: stale), without the lists. Raises the APIError that
        `take` would return."""
        update = self._update(state, out, self.gateway.clock())
        if update is not None:
            self.gateway.metrics.on_tokens(len(update.token_ids))
        return update

    def _update(self, state: RequestState, item: TokenOutput | APIError,
                now: float) -> ChoiceUpdate | None:
        """One sink item -> its update (None: stale, it arrived after its choice ended);
        raises the APIError that fails the choice."""
        choice = self.choices[state.index]
        if choice.finish_reason is not None:
            return None
        if isinstance(item, APIError):
            self._trace(choice, state, now, item)
            raise item
        try:
            update = choice.consume(item, self.gateway.metrics, now)
        except APIError as e:
            self._trace(choice, state, now, e)
            raise
        if update.finish_reason is not None:
            self._trace(choice, state, now)
            # A worker finish means the worker already forgot it; a stop string means
            # it is still generating.
            self.gateway.finish(state, abort=item.finish_reason is None)
        return update

    def _trace(self, choice: Choice, state: RequestState, now: float,
               error: APIError | None = None) -> None:
        tracer = self.gateway.tracer
        if tracer is not None:
            target = state.target
            tracer.record(choice, state.request_id, state.worker_id, self.trace_headers, now,
                          None if error is None else error.message,
                          None if target is None else target.model,
                          None if target is None else target.version)

    def close(self) -> None:
        """End every choice still open (client gone, error, slow client)."""
        for choice in self.choices:
            self.gateway.finish(choice.state, abort=True)

    @property
    def num_billed_tokens(self) -> int:
        """What the rate limit charges: usage's total, plus each prompt once more when its
        logprobs were computed (an uncached pass over the whole vocabulary at every
        position, beside the prefill the choices share). A prompt none of whose choices
        reached a worker (429 queue full, 503 queue timeout, the client gone while queued)
        never ran: it costs nothing."""
        n = len(self.choices) // max(1, len(self.prompt_lengths))
        num_ran = sum(length for k, length in enumerate(self.prompt_lengths)
                      if any(c.state.num_submits for c in self.choices[k * n:(k + 1) * n]))
        extra = num_ran if self.has_prompt_logprobs else 0
        completion = sum(c.num_output_tokens for c in self.choices)
        return num_ran + completion + extra

    def usage(self) -> dict[str, int]:
        prompt = sum(self.prompt_lengths)
        completion = sum(c.num_output_tokens for c in self.choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion}
        # Each prompt counts once, as in prompt_tokens: its n choices share one prefill (the
        # others find the first's blocks cached), so the prompt's cached tokens are the
        # fewest any of its choices found, never more than the prompt.
        n = len(self.choices) // max(1, len(self.prompt_lengths))
        cached = sum(min(c.num_cached_tokens for c in self.choices[k:k + n])
                     for k in range(0, len(self.choices), max(1, n)))
        if cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        if any(c.reasoning is not None for c in self.choices):
            usage["completion_tokens_details"] = {
                "reasoning_tokens": sum(c.num_reasoning_tokens for c in self.choices)}
        return usage
