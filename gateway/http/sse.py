"""Server-sent events with disconnect detection and a slow-client watchdog.

The stream is raced against the client's `http.disconnect` (no polling): whichever ends
first wins and the other is cancelled, so a client that goes away stops its engine
requests at once (the event source's `finally` aborts them).

A client that stops reading makes the server's `send` block once the socket buffers are
full. Two rules end such a stream (its event source's cleanup aborts the engine requests,
which frees their KV blocks; a client still there gets an error event):

- **Stalled**: one `send` stays blocked for `slow_client_timeout_s`.
- **Too slow**: over the last `slow_client_timeout_s` the stream was client-bound (a send
  was blocked for at least half of that window) and delivered fewer than `min_client_rate`
  bytes/s. A trickle reader that drains a few bytes a second completes a send now and
  then, so the first rule alone never fires for it while it holds its KV blocks forever.
  A reader slower than generation but above the rate is client-bound and kept; a stream
  waiting on the engine (slow generation, a long prefill) is not client-bound and kept.

The rate is in bytes, what the gateway sees: what a send hands to the socket. Over a
window in which the client holds the stream up, the buffers between us and the client are
full at both ends of it, so bytes handed over equal bytes the client read. For scale, a
plain completion chunk is about 200 bytes a token, so the default 1024 B/s is about five
tokens a second: any real network, far above a trickle.

Cost: per chunk (one per engine step per stream, not per token), two clock reads and two
additions; per stream, one timer that fires `_CHECKS_PER_WINDOW` times a window.

Direct writes: behind the gateway's own uvicorn protocol (gateway/http/http_protocol.py) the
response knows its request's uvicorn cycle, and `write_now` puts a chunk on the socket the
way uvicorn's `send` would (chunked framing), without the coroutine, the middleware layers
and the pump task's wake-up. It is only allowed when `send` would not have waited: the
response has started, nothing is being sent, the transport is not paused for flow control
and the client is still there. Otherwise (and under any other server) chunks go through the
pump and `send` as always; gateway/http/streaming.py decides which path each chunk takes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from zeroserve.gateway.http.held_head import start_held
from zeroserve.gateway.http.http_protocol import CYCLE_SCOPE_KEY, ON_LOST_SCOPE_KEY
from zeroserve.gateway.logging import get_logger

log = get_logger("sse")

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_FINAL_WRITE_TIMEOUT_S = 1.0
# The rate is judged over a sliding window sampled this many times per window.
_CHECKS_PER_WINDOW = 4
# Client-bound: a send was blocked for at least this share of the window.
_CLIENT_BOUND_SHARE = 0.5


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


class LastChunk(bytes):
    """What an event source yields as its last chunk (the end of a stream, or its failure):
    the response ends with it, in one write, instead of a chunk and then an empty end.
    Nothing may follow it."""


async def _until_done(task: asyncio.Future) -> None:
    """Wait for `task` to end however it ends (it is awaited again for its outcome); only
    a cancellation of the waiting task itself goes through."""
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except Exception:
        pass


class SSEResponse:
    """An ASGI response streaming `events` (already-encoded SSE bytes)."""

    def __init__(self, events: AsyncIterator[bytes], slow_client_timeout_s: float,
                 on_slow_client: Callable[[], bytes], request_id: str = "",
                 min_client_rate: float = 0.0,
                 on_disconnect: Callable[[], None] | None = None):
        self.events = events
        self.slow_client_timeout_s = slow_client_timeout_s
        self.min_client_rate = min_client_rate  # bytes/s; 0: only the stalled-send rule
        # Called when the client is too slow: ends the work, returns the error event.
        self.on_slow_client = on_slow_client
        self.request_id = request_id
        self.on_disconnect = on_disconnect  # called once the client is found gone
        self._send_started: float | None = None
        self._num_bytes_sent = 0
        self._blocked_s = 0.0  # time spent in sends that have returned
        # (time, bytes sent, blocked seconds) at the timer's checks, oldest first; the oldest
        # is the start of the window the rate is judged over.
        self._marks: deque[tuple[float, int, float]] = deque(maxlen=4 * _CHECKS_PER_WINDOW)
        self.is_slow_client = False
        self.slow_client_reason: str | None = None  # "stalled" or "too slow"
        self.is_disconnected = False
        self._is_closed = False
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # set when the response starts
        self._cycle = None  # uvicorn's RequestResponseCycle, for direct writes
        self._is_body_ended = False  # a LastChunk was sent: the response is complete

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        # Looked up once: on Python 3.11 each lookup of the running loop is a getpid() call.
        loop = self._loop = asyncio.get_running_loop()
        start = {"type": "http.response.start", "status": 200, "headers": _HEADERS}
        cycle = scope.get(CYCLE_SCOPE_KEY)
        held = None
        if cycle is not None and not cycle.response_started:
            # The head goes out with the first chunk (gateway/http/held_head.py).
            held = await start_held(cycle, send, start, loop)
        else:
            await send(start)
        set_on_lost = None
        if cycle is not None and cycle.response_started and cycle.chunked_encoding:
            self._cycle = cycle
            self._flow = cycle.flow
            self._transport = cycle.transport if held is None else held.transport
            set_on_lost = scope.get(ON_LOST_SCOPE_KEY)
        pump = loop.create_task(self._pump(send, loop))
        # The client leaving: told by our protocol's callback, else by a task that waits
        # for `http.disconnect` (any other server).
        watch = None
        if set_on_lost is not None:
            set_on_lost(lambda: self._lost(pump))
            if cycle.disconnected:  # gone before the callback was set
                self._lost(pump)
        else:
            watch = asyncio.ensure_future(wait_for_disconnect(receive))
        self._marks.append((loop.time(), 0, 0.0))
        self._timer = loop.call_later(self._check_period_s, self._check_progress, pump)
        try:
            if watch is None:
                await _until_done(pump)
            else:
                await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if set_on_lost is not None:
                set_on_lost(None)
            self._is_closed = True
            self._cycle = None
            self._timer.cancel()
            tasks = (pump,) if watch is None else (pump, watch)
            for task in tasks:
                if not task.done():
                    task.cancel()
            for task in tasks:
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                except OSError:  # the client went away in the middle of a write
                    self.is_disconnected = True
                except Exception:
                    log.exception("stream failed", extra={"request_id": self.request_id})
            await self.events.aclose()  # runs the source's cleanup (aborts what is left)
        # (The watcher also returns once the response is complete: that is no disconnect.)
        if self.is_disconnected or (watch is not None and watch.done()
                                    and not watch.cancelled() and not self._is_body_ended):
            self.is_disconnected = True
            log.info("client disconnected", extra={"request_id": self.request_id})
            if self.on_disconnect is not None:
                self.on_disconnect()
        elif self.is_slow_client:
            await self._final_write(send, self.on_slow_client())
        elif not self._is_body_ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        if held is not None:  # (still held only if nothing was written: the client left)
            held.drop()

    def _lost(self, pump: asyncio.Future) -> None:
        """The client's connection is gone: the stream stops (its cleanup aborts the work).
        After the last chunk a client may close at once: that is the response's end."""
        if self._is_body_ended:
            return
        self.is_disconnected = True
        if not pump.done():
            pump.cancel()

    def can_write_now(self) -> bool:
        """Would a chunk go straight to the socket now, as `send` would put it, unblocked?
        (No cycle: not started, closed, or not our protocol.)"""
        cycle = self._cycle
        return (cycle is not None and self._send_started is None
                and not self._flow.write_paused and not cycle.disconnected
                and not self._transport.is_closing())

    def write_now(self, chunk: bytes) -> None:
        """Write one body chunk directly; only after `can_write_now()` said True in the same
        pass of the event loop."""
        cycle = self._cycle
        if cycle is None:
            return
        # (cycle.transport: the head goes first while it is held.)
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        self._num_bytes_sent += len(chunk)

    @property
    def _check_period_s(self) -> float:
        return self.slow_client_timeout_s / _CHECKS_PER_WINDOW

    async def _pump(self, send: Send, loop: asyncio.AbstractEventLoop) -> None:
        async for chunk in self.events:
            # A LastChunk ends the body in the same write (no separate empty end).
            is_last = type(chunk) is LastChunk
            started = self._send_started = loop.time()
            await send({"type": "http.response.body", "body": chunk, "more_body": not is_last})
            self._send_started = None
            self._blocked_s += loop.time() - started
            self._num_bytes_sent += len(chunk)
            if is_last:
                self._is_body_ended = True

    def _check_progress(self, pump: asyncio.Future) -> None:
        """The watchdog: a few checks per window per stream, whatever the token rate."""
        if self._is_closed or pump.done():
            return
        loop = self._loop
        now = loop.time()
        started = self._send_started
        blocked_now_s = now - started if started is not None else 0.0
        if blocked_now_s >= self.slow_client_timeout_s:
            self._abort(pump, "stalled", blocked_s=round(blocked_now_s, 3))
            return
        rate = self._rate_if_client_bound(now, self._blocked_s + blocked_now_s)
        if rate is not None and rate < self.min_client_rate:
            self._abort(pump, "too slow", bytes_per_s=round(rate, 1),
                        min_client_rate=self.min_client_rate)
            return
        # Next check: one period on, or sooner if the send in progress reaches the timeout.
        wait = min(self._check_period_s, self.slow_client_timeout_s - blocked_now_s)
        self._timer = loop.call_later(max(wait, 0.01), self._check_progress, pump)

    def _rate_if_client_bound(self, now: float, blocked_s: float) -> float | None:
        """Bytes/s over the last window if the client held the stream up for most of it."""
        self._marks.append((now, self._num_bytes_sent, blocked_s))
        window = self.slow_client_timeout_s
        while len(self._marks) > 1 and now - self._marks[1][0] >= window * 0.999:
            self._marks.popleft()  # the second oldest spans a whole window already
        since, bytes_then, blocked_then = self._marks[0]
        span = now - since
        if self.min_client_rate <= 0 or span < window * 0.999:
            return None
        if blocked_s - blocked_then < _CLIENT_BOUND_SHARE * span:
            return None  # waiting on the engine, not on the client
        return (self._num_bytes_sent - bytes_then) / span

    def _abort(self, pump: asyncio.Future, reason: str, **details: float) -> None:
        log.warning("slow client: aborting the stream", extra={
            "request_id": self.request_id, "reason": reason,
            "timeout_s": self.slow_client_timeout_s, **details})
        self.slow_client_reason = reason
        self.is_slow_client = True
        pump.cancel()

    async def _final_write(self, send: Send, body: bytes) -> None:
        """Best effort: the client may never read it."""
        try:
            await asyncio.wait_for(send({"type": "http.response.body", "body": body,
                                         "more_body": False}), _FINAL_WRITE_TIMEOUT_S)
        except (TimeoutError, OSError):
            pass
