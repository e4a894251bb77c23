"""One streamed response: a request group's updates rendered as SSE events.

Two ways an output reaches the client, one renderer (`render`) and one credit rule (grant
once the chunk is on the client's socket):

- **The response's task** (`events()`, pumped by SSEResponse): it waits on the group's
  sink, takes everything queued, renders it as one chunk and sends it. It does the start
  and the end of a stream (a worker's finish, usage, [DONE]), failures, and any time the
  client's socket is backed up.
- **The direct path** (`_direct`, the sink's `direct` hook): in a stream's steady state
  (its task parked on an empty sink, the socket taking writes) the receive loop renders
  the output and writes it to the socket itself, then grants the credit. When the gateway
  is behind (several TOKENS messages waiting) the writes of one pass are merged per stream
  (workers.zmq_io.DeferredWrites), so each socket gets one write for all of them. With 1,000 streams
  one engine step delivers 1,000 outputs; waking 1,000 tasks to send one chunk each, each
  through a chain of generators, the ASGI send coroutine and the middleware layers, was
  ~35% of the gateway's CPU (docs/benchmarks.md, issue 13).

A failure inside the direct path fails this stream only: it is handed to the stream's task,
which ends the response as a failure in `events()` would have.

Per output the direct path does as little as it can (issue 36: at 1,000 streams it runs
50,000 times a second): one update (`RequestGroup.take_one`), and a plain text chunk
built from a template split from the renderer's own chunk (`_render_one`), the same bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from json.encoder import encode_basestring as _json_string

from zeroserve.common.protocol import TokenOutput
from zeroserve.gateway.api.openai_schema import SamplingOptions
from zeroserve.gateway.api.responses import (
    SSE_DONE,
    LogprobsFormatter,
    ResponseContext,
    chat_chunk,
    chat_delta_chunk,
    chat_role_chunk,
    completion_chunk,
    prompt_logprobs_json,
    reasoning_delta,
    spliced_logprobs_json,
    sse,
    usage_chunk,
)
from zeroserve.gateway.api.tool_calls import ToolCallStream
from zeroserve.gateway.core import Gateway
from zeroserve.gateway.errors import APIError, server_error
from zeroserve.gateway.generation import ChoiceUpdate, RequestGroup
from zeroserve.gateway.http.offload import CpuPool
from zeroserve.gateway.http.sse import LastChunk, SSEResponse
from zeroserve.gateway.logging import get_logger
from zeroserve.gateway.streams import RequestState
from zeroserve.gateway.text.tokenizer import TextTokenizer

log = get_logger("api")

# Prompt logprob values (tokens x (1 + alternatives)) formatted on the loop; more go to the
# CPU pool.
_INLINE_LOGPROB_VALUES = 4096


def update_logprobs(tokenizer: TextTokenizer, ctx: ResponseContext, update: ChoiceUpdate,
                    offset: int) -> dict | None:
    """An update's logprobs in the endpoint's shape (None without any)."""
    if update.logprobs is None or not update.token_ids:
        return None
    fmt = LogprobsFormatter(tokenizer, ctx.kind)
    if ctx.kind == "chat":
        return fmt.chat(update.token_ids, update.logprobs)
    return fmt.completion(update.token_ids, update.logprobs, offset)


def log_done(ctx: ResponseContext, group: RequestGroup) -> None:
    if not log.isEnabledFor(logging.INFO):  # (its fields are not built below that level)
        return
    log.info("request done", extra={
        "request_id": ctx.id, "elapsed_s": round(time.time() - ctx.created_at, 3),
        "finish_reasons": [c.finish_reason for c in group.choices],
        "num_output_tokens": sum(c.num_output_tokens for c in group.choices)})


class StreamedResponse:
    """Renders one request group's updates as SSE chunks, from its task or directly."""

    def __init__(self, gateway: Gateway, tokenizer: TextTokenizer, group: RequestGroup,
                 ctx: ResponseContext, sampling: SamplingOptions,
                 echoes: list[str] | None = None, cpu: CpuPool | None = None):
        self.gateway = gateway
        self.tokenizer = tokenizer
        self.group = group
        self.ctx = ctx
        self.sampling = sampling
        self.echoes = echoes
        indexes = [c.index for c in group.choices]
        self._offsets = [0] * len(indexes)  # characters sent per choice (logprob offsets)
        # Like vLLM and llama-server, the role chunk goes out with a choice's first output,
        # not before prefill, so clients that stop a TTFT clock at the first chunk measure
        # the time to the first token.
        self._needs_role = set(indexes) if ctx.kind == "chat" else set()
        self._needs_echo = set(indexes) if echoes is not None else set()
        # echo + logprobs: a choice's first chunk carries its prompt's logprobs, which come
        # once per prompt (with choice 0's first output) and are formatted once, in the CPU
        # pool when large. A choice's updates wait in `_held` until then.
        self._has_prompt_logprobs = echoes is not None and sampling.prompt_logprobs is not None
        self._prompt_json: dict[int, dict[str, str]] = {}
        self._held: dict[int, list[tuple[ChoiceUpdate, RequestState]]] = {}
        self._cpu = cpu
        self._tool_streams = ({i: ToolCallStream(ctx.tools) for i in indexes}
                              if ctx.kind == "chat" and ctx.tools is not None else None)
        self._build = chat_chunk if ctx.kind == "chat" else completion_chunk
        self._sse: SSEResponse | None = None
        self._writes = gateway.edge.writes
        self._outbox = gateway.outbox  # (Gateway.grant's, without the call, per output)
        self._templates: dict[int, tuple[str, str] | tuple[()]] = {}  # see _text_template
        # Other APIs' streams (http/responses_routes.py, http/messages.py) render their own.
        self._is_chat_or_completion = type(self).render is StreamedResponse.render
        self._failure: BaseException | None = None  # raised in the direct path

    def response(self, slow_client_timeout_s: float, on_slow_client: Callable[[], bytes],
                 min_client_rate: float, on_disconnect: Callable[[], None]) -> SSEResponse:
        self._sse = SSEResponse(self.events(), slow_client_timeout_s,
                                on_slow_client=on_slow_client, request_id=self.ctx.id,
                                min_client_rate=min_client_rate, on_disconnect=on_disconnect)
        self.group.sink.direct = self._direct
        return self._sse

    async def events(self) -> AsyncIterator[bytes]:
        group, ctx = self.group, self.ctx
        try:
            head = self.head()
            if head:
                yield head
            async for batch in group.update_batches(lambda: self._failure is not None):
                if self._has_prompt_logprobs:
                    batch = await self._echoable(batch)
                chunk = self.render(batch)
                if chunk:
                    yield chunk
                # Those chunks are on the client's socket (or there was nothing to send).
                self._grant(batch)
            if self._failure is not None:
                raise self._failure
            yield LastChunk(await self.tail())
        except APIError as e:
            log.warning("stream failed", extra={"request_id": ctx.id, "error": e.message})
            yield LastChunk(self.failed(e))
        except Exception:  # a bug rendering this stream: it ends as a failure, not cut short
            log.exception("stream failed", extra={"request_id": ctx.id})
            yield LastChunk(self.failed(
                server_error("The server failed while streaming the response.")))
        finally:
            # No reference cycles left behind (this <-> its SSEResponse, through the sink's
            # hook and the response's callbacks): what a stream leaves goes at once, not
            # at the garbage collector's next pass (issue 36: those passes over 1,000
            # requests' leftovers were a tenth of the gateway's CPU in a burst).
            group.sink.direct = None
            self._sse = None
            group.close()
            log_done(ctx, group)

    # The stream's start, end and failure; other APIs' streams (http/responses_routes.py,
    # http/messages.py) write their own.
    def head(self) -> bytes:
        """What goes out before the first output (chat and completions: nothing)."""
        return b""

    async def tail(self) -> bytes:
        """What ends a stream that finished: the usage chunk if asked for, and [DONE]."""
        if self.ctx.include_usage:
            return sse(usage_chunk(self.ctx, self.group.usage())) + SSE_DONE
        return SSE_DONE

    def failed(self, e: APIError) -> bytes:
        """What ends a stream that failed (also a slow client's, if it can be sent)."""
        return sse(e.body()) + SSE_DONE

    def _direct(self, item: tuple) -> bool:
        """The sink's hook: write a plain output (no finish, no failure) to the client now
        if its socket takes it without waiting; False leaves it to the task."""
        state, out = item
        if type(out) is not TokenOutput or out.finish_reason is not None \
                or self._failure is not None:
            return False
        sse = self._sse
        if not sse.can_write_now():
            return False
        if self._has_prompt_logprobs and state.index in self._needs_echo:
            return False  # its prompt's logprobs are awaited in the task
        group = self.group
        try:
            update = group.take_one(state, out)
            if update is not None:
                chunk = self._render_one(update)
                if chunk:
                    writes = self._writes
                    if writes.is_deferring:  # the gateway is behind: one write per pass
                        writes.add(sse, chunk)
                    else:
                        sse.write_now(chunk)
                num_tokens = len(update.token_ids)
                if num_tokens:
                    self._outbox.grant(state, num_tokens)
                if update.finish_reason is not None and group.is_finished:
                    group.sink.wake()  # a stop string ended it: the task sends the end
        except Exception as e:  # a failed choice, or this stream's bug: its task ends it
            self._failure = e
            group.sink.wake()
        return True

    async def _echoable(self, batch: list[tuple[ChoiceUpdate, RequestState]]
                        ) -> list[tuple[ChoiceUpdate, RequestState]]:
        """The updates that can be rendered now, in order per choice: a choice whose echo
        still lacks its prompt's logprobs waits (its credit with it)."""
        n = self.sampling.n
        for update, state in batch:
            prompt = update.index // n
            if update.index % n == 0 and prompt not in self._prompt_json:
                self._prompt_json[prompt] = await self._format_prompt(
                    state.prompt_token_ids, update.prompt_logprobs or [])
        ready = []
        for item in batch:
            index = item[0].index
            if index in self._held or (index in self._needs_echo
                                       and index // n not in self._prompt_json):
                self._held.setdefault(index, []).append(item)
            else:
                ready.append(item)
        for index in [i for i in self._held if i // n in self._prompt_json]:
            ready += self._held.pop(index)
        return ready

    async def _format_prompt(self, token_ids: list[int], entries: list) -> dict[str, str]:
        num_values = len(token_ids) * (1 + (self.sampling.prompt_logprobs or 0))
        if self._cpu is None or num_values <= _INLINE_LOGPROB_VALUES:
            return prompt_logprobs_json(self.tokenizer, token_ids, entries)
        return await self._cpu.run(prompt_logprobs_json, self.tokenizer, token_ids, entries)

    def _grant(self, batch: list[tuple[ChoiceUpdate, RequestState]]) -> None:
        for update, state in batch:
            self.gateway.grant(state, len(update.token_ids))

    def _render_one(self, update: ChoiceUpdate) -> bytes:
        """`render` of one update, the direct path's case: a plain chat or completion chunk
        (no role, echo, tool calls or logprobs to add) is built at once; anything else, and
        other APIs' streams, go through `render`."""
        index, text = update.index, update.text
        if self._needs_role or self._needs_echo or self._tool_streams is not None \
                or update.logprobs is not None or not self._is_chat_or_completion:
            return self.render([(update, None)])
        self._offsets[index] += len(text)
        if text and not update.reasoning and update.finish_reason is None:
            template = self._templates.get(index)
            if template is None:
                template = self._templates[index] = _text_template(self._build, self.ctx, index)
            if template:
                return (template[0] + _json_string(text) + template[1]).encode()
        if text or update.reasoning or update.finish_reason is not None:
            return self._build(self.ctx, update, None)
        return b""

    def render(self, batch: list[tuple[ChoiceUpdate, RequestState]]) -> bytes:
        """A batch of updates -> the SSE events for it, as one chunk (maybe empty)."""
        ctx, offsets, tokenizer = self.ctx, self._offsets, self.tokenizer
        out = []
        for update, _ in batch:
            index = update.index
            if index in self._needs_role:
                self._needs_role.discard(index)
                out.append(sse(chat_role_chunk(ctx, index)))
            if index in self._needs_echo:
                self._needs_echo.discard(index)
                echo = self.echoes[index // self.sampling.n]
                offsets[index] += len(echo)
                update = dataclasses.replace(update, text=echo + update.text)
                lp = update_logprobs(tokenizer, ctx, update, offsets[index])
                offsets[index] += len(update.text) - len(echo)
                if self._has_prompt_logprobs:
                    lp_json = spliced_logprobs_json(
                        self._prompt_json[index // self.sampling.n], lp)
                    out.append(completion_chunk(ctx, update, None, lp_json))
                    continue
            else:
                lp = None if update.logprobs is None else update_logprobs(
                    tokenizer, ctx, update, offsets[index])
                offsets[index] += len(update.text)
            if self._tool_streams is not None:
                out += _tool_chunks(ctx, self._tool_streams[index], update, lp)
            elif update.text or update.reasoning or update.finish_reason is not None \
                    or lp is not None:
                out.append(self._build(ctx, update, lp))
        return b"".join(out)


# A text no renderer escapes, standing in for a chunk's text to find where the text goes.
_TEXT_MARK = "zeroserve-text-mark-5f0c9a1e"


def _text_template(build: Callable[..., bytes], ctx: ResponseContext,
                   index: int) -> tuple[str, str] | tuple[()]:
    """What a plain text chunk of choice `index` holds around its JSON-quoted text: the
    chunk `build` renders, split at the text. Per token, the chunk is then the two pieces
    around the new text's JSON string, the same bytes `build` makes without its calls and
    f-strings. () when the mark is not found once (a model name holding it): no template."""
    chunk = build(ctx, ChoiceUpdate(index, _TEXT_MARK, [], None, None), None).decode()
    parts = chunk.split(_json_string(_TEXT_MARK))
    return (parts[0], parts[1]) if len(parts) == 2 else ()


def _tool_chunks(ctx: ResponseContext, stream: ToolCallStream, update: ChoiceUpdate,
                 logprobs: dict | None) -> list[bytes]:
    """A chat update of a request with tools -> its chunks: content or tool-call deltas; the
    last carries the logprobs and the finish ("tool_calls" when calls were made)."""
    deltas = stream.push(update.text)
    if update.reasoning:
        deltas.insert(0, reasoning_delta(update.reasoning))
    finish_reason = update.finish_reason
    if finish_reason is not None:
        deltas += stream.finish()
        if finish_reason == "stop" and stream.has_calls:
            finish_reason = "tool_calls"
    chunks = [chat_delta_chunk(ctx, update.index, d, None, None) for d in deltas[:-1]]
    if deltas or finish_reason is not None or logprobs is not None:
        last = deltas[-1] if deltas else {}
        chunks.append(chat_delta_chunk(ctx, update.index, last, logprobs, finish_reason))
    return chunks
