"""The OpenAI Responses API over HTTP: `POST /v1/responses` (streamed or not),
`GET`/`DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` and
`POST /v1/responses/input_tokens`.

A response runs as a chat completion (api/responses_request.py builds it): the same
template, admission, routing, credit flow, failover, constrained decoding, tool-call parsing,
metrics and traces, through `Api._generate`. Only the rendering differs: `ResponsesStream`
writes the Responses events (api/responses_output.py) where chat writes chunks, and a
non-streamed chat completion becomes a response object. With `store` (the default) the
response is kept for `previous_response_id` and the GET/DELETE routes (http/response_store.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from zeroserve.common.keys import InsecurePlaneError
from zeroserve.gateway.api.openai_schema import SamplingOptions
from zeroserve.gateway.api.responses import ResponseContext
from zeroserve.gateway.api.responses_output import (
    ResponseBuilder,
    build_response,
    new_id,
    sse_event,
)
from zeroserve.gateway.api.responses_request import (
    ResponsesRequest,
    parse_responses,
    responses_param,
    stored_items,
)
from zeroserve.gateway.api.tool_calls import ToolCallStream
from zeroserve.gateway.config import tier_responses_dir
from zeroserve.gateway.core import Gateway
from zeroserve.gateway.errors import APIError, invalid_request, server_error
from zeroserve.gateway.generation import RequestGroup
from zeroserve.gateway.http.auth import key_index
from zeroserve.gateway.http.error_response import error_response
from zeroserve.gateway.http.offload import CpuPool
from zeroserve.gateway.http.response_store import ResponseStore, is_response_id, owner_of
from zeroserve.gateway.http.routes import Api
from zeroserve.gateway.http.streaming import StreamedResponse, update_logprobs
from zeroserve.gateway.logging import get_logger
from zeroserve.gateway.text.tokenizer import TextTokenizer

log = get_logger("api")


class ResponsesStream(StreamedResponse):
    """A streamed response: Responses events instead of chat chunks, from the same updates
    (reasoning, text, tool-call deltas), on the same two write paths."""

    def __init__(self, gateway: Gateway, tokenizer: TextTokenizer, group: RequestGroup,
                 ctx: ResponseContext, sampling: SamplingOptions, echoes: None = None,
                 cpu: CpuPool | None = None, *, builder: ResponseBuilder, on_done) -> None:
        super().__init__(gateway, tokenizer, group, ctx, sampling, echoes, cpu)
        self._needs_role = set()
        self._tool_streams = None
        self.builder = builder
        self._calls = ToolCallStream(ctx.tools) if ctx.tools is not None else None
        self._on_done = on_done  # async (response object) -> None: stores it
        self._finish_reason: str | None = None

    def head(self) -> bytes:
        return b"".join(map(sse_event, self.builder.start()))

    def render(self, batch) -> bytes:
        builder, events = self.builder, []
        for update, _ in batch:
            events += builder.reasoning(update.reasoning)
            if self._calls is None:
                lp = None if update.logprobs is None else update_logprobs(
                    self.tokenizer, self.ctx, update, 0)
                events += builder.text(update.text, None if lp is None else lp["content"])
            else:
                deltas = self._calls.push(update.text)
                if update.finish_reason is not None:
                    deltas += self._calls.finish()
                for delta in deltas:
                    events += builder.chat_delta(delta)
            if update.finish_reason is not None:
                self._finish_reason = update.finish_reason
        return b"".join(map(sse_event, events))

    async def tail(self) -> bytes:
        events = self.builder.finish(self._finish_reason, self.group.usage())
        await self._on_done(self.builder.response())
        return b"".join(map(sse_event, events))

    def failed(self, e: APIError) -> bytes:
        return b"".join(map(sse_event, self.builder.fail(e)))


# Headers that name a conversation (Codex sends session-id and thread-id; older clients used
# underscores).
_SESSION_HEADERS = ("session-id", "session_id", "conversation-id", "conversation_id",
                    "thread-id")


def cache_key_of(req: ResponsesRequest, request: Request) -> str | None:
    """The conversation's name for routing (prompt_cache_key, else a session header), as a
    short digest made once: the router hashes it with every candidate worker's id on every
    pick and on every wake while the request is queued."""
    key = req.prompt_cache_key or next(
        (request.headers[h] for h in _SESSION_HEADERS if request.headers.get(h)), None)
    if not key:
        return None
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class ResponsesApi:
    def __init__(self, api: Api):
        self.api = api
        config = api.config
        folder = Path(config.responses_dir or tier_responses_dir(config.port))
        self.store = ResponseStore(folder, config.response_store_size,
                                   config.response_store_ttl_s)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/responses", self.create, methods=["POST"]),
            Route("/v1/responses/input_tokens", self.input_tokens, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/input_items", self.input_items,
                  methods=["GET"]),
        ]

    def _owner(self, request: Request) -> str:
        index = key_index(request.scope)
        keys = self.api.config.api_keys
        return owner_of(keys[index] if index is not None and index < len(keys) else None)

    # --- POST /v1/responses ----------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        try:
            owner = self._owner(request)
            api, req, history = await self._parse(request, owner)
            text = await api._render(req.chat.prompt)
            ids = await api._encode(text, add_special_tokens=False)
            response_id = new_id("resp")
            ctx = ResponseContext("chat", req.chat.model, tools=req.chat.tools,
                                  id=response_id, endpoint="responses")
            builder = ResponseBuilder(req, req.chat.model, response_id)

            async def store(response: dict) -> None:
                if req.store:
                    await self._store(owner, req, response, history)

            async def respond(chat: dict, _group: RequestGroup) -> Response:
                response = build_response(req, req.chat.model, chat, response_id).response()
                await store(response)
                return JSONResponse(response)

            def streamed_as(*args: Any) -> ResponsesStream:
                return ResponsesStream(*args, builder=builder, on_done=store)

            return await api._generate(request, ctx, [ids], req.chat.sampling, req.stream,
                                       what="input", reasoning=api.reasoning_parsers(text, req.chat.sampling),
                                       streamed_as=streamed_as, respond=respond,
                                       cache_key=cache_key_of(req, request))
        except APIError as e:
            return error_response(responses_param(e))

    async def _parse(self, request: Request, owner: str
                     ) -> tuple[Api, ResponsesRequest, list[dict] | None]:
        """The view of the model the body names (`Api.for_request`), the request, and the
        stored conversation it continues (resolved now: the response is stored with it
        even if its predecessor goes while it generates)."""
        body = await self.api._read_json(request)
        api = self.api.for_request(body, request.headers)
        history = await self._history(owner, body.get("previous_response_id"))
        args = (body, api.served_names, api.limits, history)
        if body.get("tools") or body.get("text"):  # a schema to check: off the loop
            req = await api.cpu.run(parse_responses, *args)
        else:
            req = parse_responses(*args)
        if req.dropped_tools:
            log.warning("tools this server cannot run were left out", extra={
                "tool_types": list(req.dropped_tools)[:32]})
        return api, req, history

    async def _history(self, owner: str, previous_id: Any) -> list[dict] | None:
        """The conversation a previous_response_id continues: its inputs and outputs."""
        if previous_id is None:
            return None
        if not isinstance(previous_id, str):
            raise invalid_request("'previous_response_id' must be a string.",
                                  param="previous_response_id")
        history = await self._in_store(self.store.conversation, owner, previous_id)
        if history is None:
            raise APIError(404, f"Previous response with id '{previous_id[:64]}' not found: "
                                f"it was never stored (store: false), was deleted, or is "
                                f"past the bound ({self.store.describe_bounds()}).",
                           param="previous_response_id", code="previous_response_not_found")
        return history

    async def _store(self, owner: str, req: ResponsesRequest, response: dict,
                     history: list[dict] | None) -> None:
        try:
            stored = await asyncio.to_thread(
                self.store.put, owner, response, stored_items(req.input_items),
                req.previous_response_id, history)
        except (OSError, sqlite3.Error, InsecurePlaneError) as e:  # the response is fine
            log.error("could not store a response", extra={"request_id": response["id"],
                                                           "error": str(e)})
            return
        if not stored:
            log.warning("response too large to store", extra={"request_id": response["id"]})

    # --- the stored responses ----------------------------------------------------------------

    async def _in_store(self, call, *args: Any) -> Any:
        """A store call in a thread; a store that cannot be read is the server's 500."""
        try:
            return await asyncio.to_thread(call, *args)
        except (OSError, sqlite3.Error, InsecurePlaneError) as e:
            log.error("could not read the response store", extra={"error": str(e)})
            raise server_error("The stored responses cannot be read.") from None

    async def _read(self, request: Request, read):
        """`read(owner, id)` in a thread; 404 when it finds nothing."""
        response_id = request.path_params["response_id"]
        found = None
        if is_response_id(response_id):
            found = await self._in_store(read, self._owner(request), response_id)
        if not found:
            raise APIError(404, f"Response with id '{response_id[:64]}' not found.",
                           param="response_id", code="not_found")
        return found

    async def retrieve(self, request: Request) -> Response:
        try:  # the JSON as stored: not parsed and serialised again on the loop
            body = await self._read(request, self.store.response_json)
        except APIError as e:
            return error_response(e)
        return Response(body, media_type="application/json")

    async def delete(self, request: Request) -> Response:
        try:
            await self._read(request, self.store.delete)
        except APIError as e:
            return error_response(e)
        return JSONResponse({"id": request.path_params["response_id"], "object": "response",
                             "deleted": True})

    async def input_items(self, request: Request) -> Response:
        try:
            found = await self._read(request, self.store.input_items)
        except APIError as e:
            return error_response(e)
        items = [item if "id" in item else {"id": new_id("msg"), **item} for item in found]
        return JSONResponse({"object": "list", "data": items,
                             "first_id": items[0]["id"] if items else None,
                             "last_id": items[-1]["id"] if items else None,
                             "has_more": False})

    # --- POST /v1/responses/input_tokens -----------------------------------------------------

    async def input_tokens(self, request: Request) -> Response:
        """The tokens a request's input takes (instructions, tools and history included)."""
        try:
            api, req, _ = await self._parse(request, self._owner(request))
            text = await api._render(req.chat.prompt)
            ids = await api._encode(text, add_special_tokens=False)
        except APIError as e:
            return error_response(responses_param(e))
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(ids)})
