"""Server-sent events with disconnect detection and a slow-client watchdog.

The stream is raced against the client's `http.disconnect` (no polling): whichever ends
first wins and the other is cancelled, so a client that goes away stops its engine
requests at once (the event source's `finally` aborts them).

A client that stops reading makes the server's `send` block once the socket buffers are
full. If one `send` stays blocked for `slow_client_timeout_s` the stream is aborted and,
if the client is still there, it gets an error event. Progress is timestamped per send;
a single timer per stream checks it, so nothing is added per token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gateway.logging import get_logger

log = get_logger("sse")

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_FINAL_WRITE_TIMEOUT_S = 1.0


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(work: Awaitable[Any], receive: Receive) -> tuple[bool, Any]:
    """Run `work` unless the client disconnects first: (is_disconnected, result)."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, watch):
            if not task.done():
                task.cancel()
    if work_task.done() and not work_task.cancelled():
        return False, work_task.result()  # raises what the work raised
    try:
        await work_task
    except asyncio.CancelledError:
        pass
    return True, None


class SSEResponse:
    """An ASGI response streaming `events` (already-encoded SSE bytes)."""

    def __init__(self, events: AsyncIterator[bytes], slow_client_timeout_s: float,
                 on_slow_client: Callable[[], bytes], request_id: str = ""):
        self.events = events
        self.slow_client_timeout_s = slow_client_timeout_s
        # Called when the client is too slow: ends the work, returns the error event.
        self.on_slow_client = on_slow_client
        self.request_id = request_id
        self._send_started: float | None = None
        self.is_slow_client = False
        self.is_disconnected = False
        self._is_closed = False
        self._timer: asyncio.TimerHandle | None = None

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
        loop = asyncio.get_running_loop()
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(wait_for_disconnect(receive))
        self._timer = loop.call_later(self.slow_client_timeout_s, self._check_progress, pump)
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._is_closed = True
            self._timer.cancel()
            for task in (pump, watch):
                if not task.done():
                    task.cancel()
            for task in (pump, watch):
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                except OSError:  # the client went away in the middle of a write
                    self.is_disconnected = True
                except Exception:
                    log.exception("stream failed", extra={"request_id": self.request_id})
            await self.events.aclose()  # runs the source's cleanup (aborts what is left)
        if self.is_disconnected or (watch.done() and not watch.cancelled()):
            self.is_disconnected = True
            log.info("client disconnected", extra={"request_id": self.request_id})
        elif self.is_slow_client:
            await self._final_write(send, self.on_slow_client())
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        async for chunk in self.events:
            self._send_started = loop.time()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self._send_started = None

    def _check_progress(self, pump: asyncio.Future) -> None:
        """The watchdog: fires at most once per timeout period per stream."""
        if self._is_closed or pump.done():
            return
        loop = asyncio.get_running_loop()
        started = self._send_started
        if started is not None and loop.time() - started >= self.slow_client_timeout_s:
            log.warning("slow client: aborting the stream",
                        extra={"request_id": self.request_id,
                               "timeout_s": self.slow_client_timeout_s})
            self.is_slow_client = True
            pump.cancel()
            return
        wait = self.slow_client_timeout_s
        if started is not None:
            wait -= loop.time() - started
        self._timer = loop.call_later(max(wait, 0.01), self._check_progress, pump)

    async def _final_write(self, send: Send, body: bytes) -> None:
        """Best effort: the client may never read it."""
        try:
            await asyncio.wait_for(send({"type": "http.response.body", "body": body,
                                         "more_body": False}), _FINAL_WRITE_TIMEOUT_S)
        except (asyncio.TimeoutError, OSError):
            pass
