"""DEBUG_REQUEST -> DEBUG_REPLY calls to workers: stacks, profiles and memory views of a
worker process, answered by its link thread (worker/debug.py), so they work while its engine
thread is hung.

Each call has a random token; the reply with that token from that same worker resolves it.
A worker that is not connected is a 404, one that does not answer in time a 504, and what
the worker refused keeps its meaning: busy (a profile runs there already) 409, bad
arguments 400, anything else 502.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from typing import Any

from zeroserve.common.protocol import DebugReply, DebugRequest, Message
from zeroserve.gateway.errors import APIError

MAX_PENDING = 64  # calls in flight at once, all workers together

_STATUS_BY_CODE = {"busy": 409, "bad_args": 400, "timeout": 504, "unavailable": 501}


class DebugCalls:
    def __init__(self, send: Callable[[str, Message], bool]):
        self._send = send  # (worker id, message) -> whether it left
        self._pending: dict[str, tuple[str, asyncio.Future]] = {}
        # Called by end_all (the gateway's shutdown): the gateway's own profiles stop too.
        self.on_end: list[Callable[[], None]] = []

    async def call(self, worker_id: str, kind: str, args: dict[str, Any],
                   timeout_s: float) -> dict[str, Any]:
        """The worker's answer (a dict), or APIError."""
        if len(self._pending) >= MAX_PENDING:
            raise APIError(429, "Too many debug calls are in flight; retry later.",
                           type="rate_limit_error", code="too_many_debug_calls")
        token = secrets.token_hex(16)
        future = asyncio.get_running_loop().create_future()
        self._pending[token] = (worker_id, future)
        try:
            if not self._send(worker_id, DebugRequest(token, kind, args)):
                raise worker_not_found(worker_id)
            try:
                reply: DebugReply = await asyncio.wait_for(future, timeout_s)
            except TimeoutError:
                raise APIError(504, f"Worker {worker_id!r} did not answer within "
                                    f"{timeout_s:g}s (its link thread may be stuck too, or "
                                    "the reply was lost).", type="timeout_error",
                               code="worker_timeout") from None
        finally:
            self._pending.pop(token, None)
        if not reply.ok:
            status = _STATUS_BY_CODE.get(reply.code, 502)
            raise APIError(status, f"Worker {worker_id!r}: {reply.error}",
                           type="invalid_request_error" if status < 500 else "server_error",
                           code=f"debug_{reply.code}")
        return reply.result

    def end_all(self, error: APIError) -> None:
        """The server is stopping: every call waiting for a worker ends with `error` now,
        while its client can still be told (not when the server cancels it)."""
        for _, future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        for end in self.on_end:
            end()

    def on_reply(self, worker_id: str, msg: DebugReply) -> None:
        """A DEBUG_REPLY from `worker_id` (the receive loop): only the asker's token and
        worker resolve a call; late or stray replies are dropped."""
        entry = self._pending.get(msg.token)
        if entry is not None and entry[0] == worker_id and not entry[1].done():
            entry[1].set_result(msg)


def worker_not_found(worker_id: str) -> APIError:
    return APIError(404, f"No worker with id {worker_id!r} is connected.",
                    code="worker_not_found")
