"""The debug API: a live look inside the gateway or a worker (`zeroserve debug ...`), behind
the admin API's rights (gateway/http/admin.py: an admin key, else loopback clients only, and
never a web page).

    GET  /admin/debug/stacks[?worker=ID]      every thread's Python stack (and, for the
                                              gateway, every asyncio task); `&format=text`:
                                              as a traceback, text/plain
    POST /admin/debug/profile                 {"seconds": 5, "hz": 100, "limit": 40,
                                              "thread": NAME, "worker": ID, "format": "json"}:
                                              a sampling CPU profile: collapsed stacks, a top
                                              table, CPU seconds per thread ("format":
                                              "collapsed" or "top": text/plain; "thread": only
                                              threads whose name starts with it)
    POST /admin/debug/memory                  {"action": "diff"|"start"|"snapshot"|"stop",
                                              "seconds": 5, "limit": 25, "frames": 1,
                                              "worker": ID}: top allocation sites since a
                                              baseline (tracemalloc, started on demand)
    POST /admin/debug/torch-profile           {"worker": ID, "seconds": 5}: the torch
                                              profiler around the worker's engine steps; the
                                              chrome trace (and where the worker saved it)

Without `worker` the gateway answers about itself. A worker answers from its link thread
(worker/debug.py), so stacks come back while its engine thread is hung. One profile (or
timed memory view) at a time per process: a second gets 409. When the server stops, a call
waiting for a worker gets a 503 and the gateway's own profile answers with what it has.
"""

from __future__ import annotations

import asyncio
import json

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from zeroserve.common.introspection import (
    MAX_PROFILE_SECONDS,
    Busy,
    MemoryArgs,
    ProfileArgs,
    format_stacks,
    format_top,
    number_arg,
)
from zeroserve.common.protocol import MAX_NAME_CHARS
from zeroserve.gateway.core import Gateway
from zeroserve.gateway.errors import APIError, invalid_request
from zeroserve.gateway.http.admin import AdminApi, json_object_body
from zeroserve.gateway.http.error_response import error_response
from zeroserve.gateway.observability.debug_view import GatewayDebug

STACKS_TIMEOUT_S = 10.0
REPLY_MARGIN_S = 15.0  # beyond a timed call's seconds, for the reply to arrive
TORCH_GRACE_S = 75.0  # the worker waits 60 s for its engine thread, then replies
_FORMATS = ("json", "collapsed", "top")


class DebugApi:
    def __init__(self, admin: AdminApi, gateway: Gateway):
        self.admin = admin
        self.gateway = gateway
        self.view = GatewayDebug()
        gateway.debug_calls.on_end.append(self.view.stop_all)  # at the server's shutdown

    def routes(self) -> list[Route]:
        return [
            Route("/admin/debug/stacks", self.stacks, methods=["GET"]),
            Route("/admin/debug/profile", self.profile, methods=["POST"]),
            Route("/admin/debug/memory", self.memory, methods=["POST"]),
            Route("/admin/debug/torch-profile", self.torch_profile, methods=["POST"]),
        ]

    async def stacks(self, request: Request) -> Response:
        try:
            self._check(request)
            output = request.query_params.get("format", "json")
            if output not in ("json", "text"):
                raise invalid_request("'format' must be json or text", param="format")
            worker_id = _worker_arg(request.query_params.get("worker"))
            if worker_id is None:
                answer = self.view.stacks()
            else:
                answer = await self.gateway.debug_calls.call(worker_id, "stacks", {},
                                                             STACKS_TIMEOUT_S)
        except APIError as e:
            return error_response(e)
        if output == "text":
            return PlainTextResponse(format_stacks(answer))
        return JSONResponse(answer)

    async def profile(self, request: Request) -> Response:
        try:
            self._check(request)
            body = await _body(request, {"seconds", "hz", "limit", "thread", "worker",
                                         "format"})
            args = _parse(ProfileArgs.parse, body)
            output = body.get("format", "json")
            if output not in _FORMATS:
                raise invalid_request(f"'format' must be one of {', '.join(_FORMATS)}",
                                      param="format")
            worker_id = _worker_arg(body.get("worker"))
            if worker_id is None:
                answer = await self._locally(self.view.profile(args))
            else:
                answer = await self.gateway.debug_calls.call(
                    worker_id, "profile", args.to_dict(), args.seconds + REPLY_MARGIN_S)
        except APIError as e:
            return error_response(e)
        if output == "collapsed":
            return PlainTextResponse(answer["collapsed"])
        if output == "top":
            return PlainTextResponse(format_top(answer))
        return JSONResponse(answer)

    async def memory(self, request: Request) -> Response:
        try:
            self._check(request)
            body = await _body(request, {"action", "seconds", "limit", "frames", "worker"})
            args = _parse(MemoryArgs.parse, body)
            worker_id = _worker_arg(body.get("worker"))
            if worker_id is None:
                answer = await self._locally(self.view.memory_view(args))
            else:
                wait_s = args.seconds if args.action == "diff" else 0.0
                answer = await self.gateway.debug_calls.call(
                    worker_id, "memory", args.to_dict(), wait_s + REPLY_MARGIN_S)
        except APIError as e:
            return error_response(e)
        return JSONResponse(answer)

    async def torch_profile(self, request: Request) -> Response:
        try:
            self._check(request)
            body = await _body(request, {"seconds", "worker"})
            seconds = _parse(lambda b: number_arg(b, "seconds", 5.0, 0.01,
                                                  MAX_PROFILE_SECONDS), body)
            worker_id = _worker_arg(body.get("worker"))
            if worker_id is None:
                raise invalid_request("The torch profiler runs in a worker: name it "
                                      "('worker').", param="worker")
            answer = await self.gateway.debug_calls.call(
                worker_id, "torch_profile", {"seconds": seconds}, seconds + TORCH_GRACE_S)
            # Up to 12 MiB of trace: checked and written out on a thread, not the loop.
            body = await asyncio.to_thread(_torch_profile_body, answer)
        except APIError as e:
            return error_response(e)
        return Response(body, media_type="application/json")

    # --- helpers -------------------------------------------------------------------------

    def _check(self, request: Request) -> None:
        refusal = self.admin.refusal(request)
        if refusal is not None:
            raise refusal

    @staticmethod
    async def _locally(call) -> dict:
        try:
            return await call
        except Busy as e:
            raise APIError(409, str(e), code="debug_busy") from None
        except ValueError as e:  # e.g. a memory snapshot before start
            raise invalid_request(str(e)) from None


def _torch_profile_body(answer: dict) -> bytes:
    """The answer as JSON, its `trace` (the worker's JSON text) as JSON rather than a string
    (checked: a trace that is not JSON is a 502)."""
    trace = answer.get("trace")
    if isinstance(trace, str):
        try:
            answer = {**answer, "trace": json.loads(trace)}
        except ValueError:
            raise APIError(502, "The worker's trace is not JSON.", type="server_error",
                           code="debug_failed") from None
    try:
        return json.dumps(answer, ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode()
    except ValueError:  # NaN or Infinity in it: not JSON a client can read
        raise APIError(502, "The worker's trace is not JSON.", type="server_error",
                       code="debug_failed") from None


def _worker_arg(value) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > MAX_NAME_CHARS:
        raise invalid_request("'worker' must be a worker id.", param="worker")
    return value


def _parse(parse, body: dict):
    try:
        return parse(body)
    except ValueError as e:
        message = str(e)
        param = message.split("'")[1] if message.count("'") >= 2 else None
        raise invalid_request(message, param=param) from None


async def _body(request: Request, allowed: set[str]) -> dict:
    body = json_object_body(await request.body(), allow_empty=True)
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid_request(f"Unknown field {unknown[0][:64]!r}; this call takes "
                              f"{', '.join(sorted(allowed))}.", param=unknown[0][:64])
    return body
