"""HTTP handlers: validate, tokenize, admit, then stream or collect the result."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from zeroserve.common.logging_setup import printable
from zeroserve.gateway.admission import Ticket
from zeroserve.gateway.api.limits import RequestLimits, check_submit_fits
from zeroserve.gateway.api.model_choice import requested_model, sticky_key
from zeroserve.gateway.api.openai_schema import (
    ChatPrompt,
    SamplingOptions,
    check_context,
    check_token_ids,
    parse_chat,
    parse_completion,
    parse_tokenize,
)
from zeroserve.gateway.api.responses import (
    LogprobsFormatter,
    ResponseContext,
    chat_response,
    completion_body,
    completion_response,
    prompt_logprobs_json,
    spliced_logprobs_json,
)
from zeroserve.gateway.api.tool_calls import parse_calls, prepare_messages
from zeroserve.gateway.config import GatewayConfig
from zeroserve.gateway.core import Gateway, random_hex
from zeroserve.gateway.errors import APIError, client_too_slow, invalid_request, model_not_found
from zeroserve.gateway.generation import RequestGroup
from zeroserve.gateway.http.early_shed import arrival_of
from zeroserve.gateway.http.error_response import error_response
from zeroserve.gateway.http.offload import CpuPool
from zeroserve.gateway.http.rate_limit import rate_limit_client, track_usage
from zeroserve.gateway.http.request_body import parse_json_object, read_body
from zeroserve.gateway.http.sse import race_disconnect
from zeroserve.gateway.http.streaming import (
    StreamedResponse,
    log_done,
    update_logprobs,
)
from zeroserve.gateway.logging import get_logger
from zeroserve.gateway.observability.tracing import trace_headers
from zeroserve.gateway.text.chat_template import ChatTemplate, ChatTemplateError
from zeroserve.gateway.text.model_texts import ModelText
from zeroserve.gateway.text.reasoning import ReasoningParser, reasoning_syntax
from zeroserve.gateway.text.tokenizer import TextTokenizer
from zeroserve.gateway.workers.models import Target, UnknownModel

log = get_logger("api")

# When no worker ever said HELLO and the model files do not say either.
_FALLBACK_MAX_MODEL_LEN = 2048
# Another API's whole response from the collected chat completion and its group.
Respond = Callable[[dict, RequestGroup], Awaitable[Response]]
# Work below these sizes runs on the loop (well under a millisecond: a thread hop would
# cost more); above them it goes to the CPU pool.
_INLINE_CHARS = 2048
_INLINE_MESSAGES = 16
_INLINE_TOKENS = 4096
# Request fields whose checking compiles a grammar (gateway/api/structured_output.py).
_GRAMMAR_FIELDS = ("response_format", "tools", "guided_json", "guided_regex")


class Api:
    """The OpenAI API. One instance per served model (a *view*: the same gateway, CPU pool
    and config, that model's tokenizer, template and limits); `for_request` picks the view
    a request's `model` names and gives it the request's target (its model, and version
    where an alias or `NAME@VERSION` chose one). The first view is the default model's."""

    def __init__(self, config: GatewayConfig, gateway: Gateway, tokenizer: TextTokenizer,
                 template: ChatTemplate, served_names: tuple[str, ...],
                 others: tuple[ModelText, ...] = ()):
        self.config = config
        self.gateway = gateway
        self.tokenizer = tokenizer
        self.template = template
        self.served_names = served_names  # the first is the one /v1/models lists
        self.started = int(time.time())
        self.limits = RequestLimits.from_config(config, tokenizer.vocab_size)
        self.cpu = CpuPool()
        # A reasoning model's <think> syntax (--reasoning-parser, or seen in the template).
        self.reasoning = reasoning_syntax(config.reasoning_parser, template.source)
        self.model_name = gateway.models.default  # the served model this view speaks for
        self.root = config.model  # its files
        self.target = Target(self.model_name)  # where this view's requests go
        self.views: dict[str, Api] = {self.model_name: self}
        for text in others:
            self.views[text.name] = self._view_of(text)

    def _view_of(self, text: ModelText) -> Api:
        view = copy.copy(self)
        view.tokenizer, view.template = text.tokenizer, text.template
        view.served_names = (text.name,)
        view.limits = RequestLimits.from_config(self.config, text.tokenizer.vocab_size)
        view.reasoning = reasoning_syntax(None, text.template.source)
        view.model_name, view.root, view.target = text.name, text.path, Target(text.name)
        return view

    def for_request(self, body: Mapping, headers: Mapping[str, str],
                    fallback: Callable[[str], bool] | None = None) -> Api:
        """The view of the model `body` names (its alias resolved by the request's sticky
        key), or a 404 in OpenAI's shape. `fallback(name)`: an unknown name that means the
        default model (Anthropic's clients send claude-… names)."""
        requested = requested_model(body)
        models = self.gateway.models
        if requested is None or (len(self.views) == 1 and requested in self.served_names):
            return self  # one model, as ever: no copy
        try:
            target = models.resolve(requested, sticky_key(body, headers))
        except UnknownModel:
            if fallback is not None and fallback(requested):
                return self
            raise model_not_found(requested) from None
        base = self.views[target.model]
        view = copy.copy(base)
        view.target = target
        view.served_names = tuple(dict.fromkeys((requested, *base.served_names)))
        return view

    @property
    def max_model_len(self) -> int:
        return (self.gateway.registry.max_model_len(self.model_name) or self.tokenizer.max_model_len
                or _FALLBACK_MAX_MODEL_LEN)

    # --- simple endpoints ------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        """Every served model, then every alias (its weights under `weights`)."""
        cards = [view._model_card() for view in self.views.values()]
        cards += [self._alias_card(name) for name in sorted(self.gateway.models.aliases)]
        return JSONResponse({"object": "list", "data": cards})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model}: OpenAI's retrieve (the openai client's models.retrieve);
        any served name, alias or NAME@VERSION finds the model."""
        name = request.path_params["model"]
        models = self.gateway.models
        if name in self.served_names:
            return JSONResponse(self._model_card())
        try:
            target = models.resolve(name, key="")
        except UnknownModel:
            return error_response(model_not_found(name))
        if name in models.aliases:
            return JSONResponse(self._alias_card(name))
        return JSONResponse(self.views[target.model]._model_card())

    def _model_card(self) -> dict:
        versions = sorted({w.version for w in self.gateway.registry.workers.values()
                           if w.model == self.model_name})
        return {"id": self.served_names[0], "object": "model", "created": self.started,
                "owned_by": "zeroserve", "root": self.root, "parent": None,
                "max_model_len": self.max_model_len, "versions": versions}

    def _alias_card(self, name: str) -> dict:
        alias = self.gateway.models.aliases[name]
        first = alias.weights[0][0].model
        return {"id": name, "object": "model", "created": self.started,
                "owned_by": "zeroserve", "root": self.views[first].root, "parent": None,
                "max_model_len": self.views[first].max_model_len,
                "weights": alias.describe()["weights"]}

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await self._read_json(request)
            api = self.for_request(body, request.headers)
            spec = await api._parse(parse_tokenize, body)
            if "chat" in spec:
                text = await api._render(spec["chat"])
            else:
                text = spec["prompt"]
            ids = await api._encode(text, spec["add_special_tokens"])
        except APIError as e:
            return error_response(e)
        if len(ids) <= _INLINE_TOKENS:
            return JSONResponse({"tokens": ids, "count": len(ids),
                                 "max_model_len": api.max_model_len})
        return Response(await self.cpu.run(_tokenize_body, ids, api.max_model_len),
                        media_type="application/json")

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await self._read_json(request)
            api = self.for_request(body, request.headers)
            ids = body.get("tokens")
            if not isinstance(ids, list):
                raise invalid_request("'tokens' must be an array of token ids.", param="tokens")
            if len(ids) <= _INLINE_TOKENS:
                text = api._detokenize_now(ids)
            else:
                text = await self.cpu.run(api._detokenize_now, ids)
        except APIError as e:
            return error_response(e)
        return JSONResponse({"prompt": text})

    def _detokenize_now(self, ids: list) -> str:
        if not all(type(t) is int for t in ids):
            raise invalid_request("'tokens' must be an array of token ids.", param="tokens")
        check_token_ids(ids, self.limits.vocab_size, param="tokens")
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # --- generation ------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        try:
            body = await self._read_json(request)
            return await self.for_request(body, request.headers)._completions(request, body)
        except APIError as e:
            return error_response(e)

    async def _completions(self, request: Request, body: dict) -> Response:
        try:
            req = await self._parse(parse_completion, body)
            prompts = []
            echoes = [] if req.echo else None
            for p in req.prompts:
                if isinstance(p, str):
                    ids = await self._encode(p)
                else:
                    # Against the context first: a long list costs a loop to check.
                    check_context(len(p), req.sampling.max_tokens, self.max_model_len)
                    check_token_ids(p, self.limits.vocab_size)
                    ids = list(p)
                prompts.append(ids)
                if echoes is not None:
                    echoes.append(p if isinstance(p, str) else
                                  self.tokenizer.decode(ids, skip_special_tokens=False))
            ctx = ResponseContext("completion", req.model, req.include_usage,
                                  id=f"cmpl-{random_hex()}")
            return await self._generate(request, ctx, prompts, req.sampling, req.stream,
                                        echoes=echoes)
        except APIError as e:
            return error_response(e)

    async def chat(self, request: Request) -> Response:
        try:
            body = await self._read_json(request)
            return await self.for_request(body, request.headers)._chat(request, body)
        except APIError as e:
            return error_response(e)

    async def _chat(self, request: Request, body: dict) -> Response:
        try:
            req = await self._parse(parse_chat, body)
            text = await self._render(req.prompt)
            ids = await self._encode(text, add_special_tokens=False)
            ctx = ResponseContext("chat", req.model, req.include_usage, tools=req.tools,
                                  id=f"chatcmpl-{random_hex()}")
            return await self._generate(request, ctx, [ids], req.sampling, req.stream,
                                        what="messages",
                                        reasoning=self.reasoning_parsers(text, req.sampling))
        except APIError as e:
            return error_response(e)

    # --- request preparation: bounded, and off the loop when large ---------------------

    def reasoning_parsers(self, prompt_text: str, sampling: SamplingOptions
                          ) -> Callable[[], ReasoningParser] | None:
        """A maker of one reasoning parser per choice of a chat-style prompt. None: the
        model does not reason, or a grammar shapes the whole output (JSON, a forced call),
        which then has no thinking to split off (in a prompt that opened <think>, the JSON
        would otherwise all count as thinking)."""
        syntax = self.reasoning
        if syntax is None or sampling.grammar is not None:
            return None
        return lambda: syntax.parser(prompt_text)

    async def _read_json(self, request: Request) -> dict:
        raw = await read_body(request, self.config.max_request_body_bytes,
                              self.config.request_body_timeout_s)
        return await parse_json_object(raw, self.cpu)

    async def _parse(self, parse, body: dict):
        """parse(body, ...) -> a typed request; in the CPU pool when it holds a schema or
        tools: checking a large JSON schema with the grammar engine takes up to a second."""
        if any(body.get(k) is not None for k in _GRAMMAR_FIELDS):
            return await self.cpu.run(parse, body, self.served_names, self.limits)
        return parse(body, self.served_names, self.limits)

    async def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= _INLINE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens)
        return await self.cpu.run(self.tokenizer.encode, text, add_special_tokens)

    async def _render(self, prompt: ChatPrompt) -> str:
        """The text a chat prompt puts in front of the model (tools included). Earlier
        calls' arguments are parsed as JSON on the way: in the CPU pool when large."""
        if (prompt.num_chars <= _INLINE_CHARS and len(prompt.messages) <= _INLINE_MESSAGES
                and prompt.tools is None and not prompt.extra_template_kwargs):
            return self._render_now(prompt)
        return await self.cpu.run(self._render_now, prompt)

    def _render_now(self, prompt: ChatPrompt) -> str:
        messages, tool_kwargs = prepare_messages(prompt.messages, prompt.tools,
                                                 self.template.source)
        extra = tool_kwargs | prompt.extra_template_kwargs
        try:
            return self.template.render(messages, prompt.add_generation_prompt,
                                        prompt.continue_final_message, **extra)
        except ChatTemplateError as e:
            raise invalid_request(f"The chat template rejected the messages: {e}",
                                  param="messages") from None


    async def _generate(self, request: Request, ctx: ResponseContext, prompts: list[list[int]],
                        sampling: SamplingOptions, stream: bool, what: str = "prompt",
                        echoes: list[str] | None = None,
                        reasoning: Callable[[], ReasoningParser] | None = None,
                        streamed_as: Callable[..., StreamedResponse] = StreamedResponse,
                        respond: Respond | None = None,
                        cache_key: str | None = None) -> Response:
        """`echoes`: per prompt, the text that comes before its completions (echo);
        `reasoning`: makes each choice's reasoning parser (chat-style prompts). Other APIs
        over chat (http/responses_routes.py, http/messages.py) stream with their
        `streamed_as` class and `respond` with the collected chat completion (and the
        group, for what the body does not say: which stop string ended a choice)."""
        group = RequestGroup(self.gateway, trace_headers=None if self.gateway.tracer is None
                             else trace_headers(request.headers))
        # Every prompt is checked before any is registered: a 400 for the last prompt must
        # leave nothing of the first ones behind.
        max_tokens_of = [self._check_prompt(ids, sampling, what) for ids in prompts]
        ticket = self._ticket(request, sampling)
        # What it may cost is reserved against the client's rate limit (429 if it lacks it);
        # prompt logprobs are one more pass over each prompt (RequestGroup.num_billed_tokens).
        group.has_prompt_logprobs = sampling.prompt_logprobs is not None
        num_passes = 2 if group.has_prompt_logprobs else 1
        num_tokens = num_passes * sum(map(len, prompts)) + sampling.n * sum(max_tokens_of)
        try:
            track_usage(request, group, num_tokens, self.model_name)
        except APIError as e:
            self.gateway.metrics.on_refused(e)
            raise
        for ids, max_tokens in zip(prompts, max_tokens_of, strict=True):
            group.prompt_lengths.append(len(ids))
            for i in range(sampling.n):
                # Scoring (max_tokens 0): the worker makes one token, which is dropped.
                group.add(ids, sampling.worker_params(max(1, max_tokens), i), self.tokenizer,
                          sampling.stop, sampling.skip_special_tokens, sampling.is_scoring,
                          None if reasoning is None else reasoning(), cache_key)
        for choice in group.choices:
            choice.state.target = self.target
            choice.state.ticket = ticket
        self.gateway.metrics.on_api_request(ctx.endpoint)
        if log.isEnabledFor(logging.INFO):  # (its fields are not built below that level)
            log.info("request", extra={
                "request_id": ctx.id, "kind": ctx.endpoint, "stream": stream,
                "num_prompt_tokens": sum(group.prompt_lengths),
                "engine_request_ids": [c.state.request_id for c in group.choices]})
        try:
            # At once when a worker can take it; else raced against the client leaving
            # while it waits in the queue.
            if group.submit_now():
                is_gone = False
                if ticket.arrival is not None:  # at a worker (gateway/http/early_shed.py)
                    ticket.arrival.done()
            else:
                is_gone = (await race_disconnect(group.submit(), request.receive))[0]
        except APIError as e:
            group.close()
            self.gateway.metrics.on_refused(e)
            raise
        metrics = self.gateway.metrics
        if is_gone:
            group.close()
            metrics.on_aborted("disconnect")
            return Response(status_code=499)
        if stream:
            def on_slow_client() -> bytes:
                metrics.on_aborted("slow_client")
                return streamed.failed(client_too_slow(self.config.slow_client_timeout_s))

            streamed = streamed_as(self.gateway, self.tokenizer, group, ctx, sampling, echoes,
                                   self.cpu)
            return streamed.response(self.config.slow_client_timeout_s, on_slow_client,
                                     self.config.min_client_rate,
                                     on_disconnect=lambda: metrics.on_aborted("disconnect"))
        try:
            is_gone, result = await race_disconnect(
                self._collect(group, ctx, sampling, echoes, respond), request.receive)
        finally:
            group.close()
            log_done(ctx, group)
        if is_gone:
            log.info("client disconnected", extra={"request_id": ctx.id})
            metrics.on_aborted("disconnect")
            return Response(status_code=499)
        return result

    def _ticket(self, request: Request, sampling: SamplingOptions) -> Ticket:
        """Where the request queues (gateway/admission.py): its key's class for this model,
        or the lower one it asks for (`priority`), and its client."""
        priorities = self.gateway.priorities
        client = rate_limit_client(request.scope)
        key = client if type(client) is int else None
        asked = sampling.priority
        if isinstance(asked, str) and priorities.classes.rank_of(asked) is None:
            raise invalid_request(f"'priority': unknown priority class {printable(asked)!r}; "
                                  f"the classes are {', '.join(priorities.classes.names)}.",
                                  param="priority")
        rank = priorities.classes.effective_rank(priorities.ceiling(key, self.model_name), asked)
        return Ticket(rank, client, priorities.share(key), arrival_of(request.scope))

    def _check_prompt(self, ids: list[int], sampling: SamplingOptions, what: str) -> int:
        """The max_tokens in effect for this prompt; a 400 when it does not fit."""
        max_tokens = check_context(len(ids), sampling.max_tokens, self.max_model_len, what,
                                   self.limits.max_tokens_limit)
        check_submit_fits(ids, sampling.worker_params(max_tokens, 0), self.config.credit_window)
        return max_tokens

    async def _collect(self, group: RequestGroup, ctx: ResponseContext,
                       sampling: SamplingOptions, echoes: list[str] | None = None,
                       respond: Respond | None = None) -> Response:
        """The whole response; `respond` (see _generate) renders a chat completion."""
        n = sampling.n
        texts = [""] * len(group.choices)
        thoughts = [""] * len(group.choices)
        if echoes is not None:
            texts = [echoes[c.index // n] for c in group.choices]
        logprobs: list[dict | None] = [None] * len(group.choices)
        # echo + logprobs: per prompt, its ids and the logprob entries its choice 0 brought.
        prompt_entries: dict[int, tuple[list[int], list]] = {}
        async for batch in group.update_batches():
            for update, state in batch:
                if (sampling.prompt_logprobs is not None and update.index % n == 0
                        and update.index // n not in prompt_entries):
                    prompt_entries[update.index // n] = (state.prompt_token_ids,
                                                         update.prompt_logprobs or [])
                lp = update_logprobs(self.tokenizer, ctx, update, len(texts[update.index]))
                if lp is not None:
                    logprobs[update.index] = LogprobsFormatter.merge(logprobs[update.index], lp)
                texts[update.index] += update.text
                thoughts[update.index] += update.reasoning
                self.gateway.grant(state, len(update.token_ids))
        if sampling.logprobs is not None and ctx.kind == "chat":
            logprobs = [lp or {"content": []} for lp in logprobs]
        choices = []
        for c in group.choices:
            if ctx.kind == "chat":
                message: dict = {"role": "assistant", "content": texts[c.index]}
                if c.reasoning is not None:
                    thought = thoughts[c.index] or None
                    message.update(reasoning_content=thought, reasoning=thought)
                finish_reason = c.finish_reason
                if ctx.tools is not None:
                    content, calls = parse_calls(texts[c.index], ctx.tools)
                    message["content"] = content
                    if calls:
                        message["tool_calls"] = [call.to_openai() for call in calls]
                        if finish_reason == "stop":
                            finish_reason = "tool_calls"
                choices.append({"index": c.index, "message": message,
                                "logprobs": logprobs[c.index], "finish_reason": finish_reason})
            else:
                choices.append({"index": c.index, "text": texts[c.index],
                                "logprobs": logprobs[c.index], "finish_reason": c.finish_reason})
        if sampling.prompt_logprobs is not None:
            return await self._echoed_logprobs_response(ctx, choices, group, logprobs,
                                                        prompt_entries, sampling)
        build = chat_response if ctx.kind == "chat" else completion_response
        body = build(ctx, choices, group.usage())
        return JSONResponse(body) if respond is None else await respond(body, group)

    async def _echoed_logprobs_response(self, ctx: ResponseContext, choices: list[dict],
                                        group: RequestGroup, logprobs: list[dict | None],
                                        prompt_entries: dict[int, tuple[list[int], list]],
                                        sampling: SamplingOptions) -> Response:
        """echo + logprobs: each prompt's logprobs formatted and rendered once, spliced
        into its n choices; in the CPU pool when large (a long prompt with top-20
        alternatives is hundreds of thousands of values)."""
        n = sampling.n
        for c in group.choices[::n]:  # a prompt whose choice 0 brought none: no values
            prompt_entries.setdefault(c.index // n, (c.state.prompt_token_ids, []))
        args = (self.tokenizer, ctx, choices, group.usage(), logprobs, prompt_entries, n)
        num_values = (sum(len(ids) for ids, _ in prompt_entries.values())
                      * (1 + (sampling.prompt_logprobs or 0)))
        if num_values <= _INLINE_TOKENS:
            body = _echoed_logprobs_body(*args)
        else:
            body = await self.cpu.run(_echoed_logprobs_body, *args)
        return Response(body, media_type="application/json")


def _echoed_logprobs_body(tokenizer: TextTokenizer, ctx: ResponseContext, choices: list[dict],
                          usage: dict, logprobs: list[dict | None],
                          prompt_entries: dict[int, tuple[list[int], list]], n: int) -> bytes:
    prompt_json = {p: prompt_logprobs_json(tokenizer, ids, entries)
                   for p, (ids, entries) in prompt_entries.items()}
    spliced = [spliced_logprobs_json(prompt_json[c["index"] // n], logprobs[c["index"]])
               for c in choices]
    return completion_body(ctx, choices, usage, spliced)


def _tokenize_body(ids: list[int], max_model_len: int) -> bytes:
    """/tokenize's JSON for many ids, in slices: json.dumps of 400k ids holds the GIL for
    ~50 ms in one C call, while between slices the event loop gets its turn."""
    parts = [",".join(map(str, ids[i:i + _INLINE_TOKENS]))
             for i in range(0, len(ids), _INLINE_TOKENS)]
    return (f'{{"tokens":[{",".join(parts)}],"count":{len(ids)},'
            f'"max_model_len":{max_model_len}}}').encode()
