"""uvicorn's httptools protocol with a deadline and a size cap for the request head.

uvicorn has no header-read timeout: a client that connects and sends nothing, or a header
line a minute, holds a connection (and its memory) for as long as it likes, and httptools
puts no bound on the head's size. Here a timer starts when the connection opens and again
when a new request begins, and stops when its head is complete; if it fires, the connection
is closed. A head larger than `max_head_bytes` gets 431 and the connection is closed.
Bodies have their own timeout in gateway/http/request_body.py.

Each connection's kernel send buffer is capped (`send_buffer_bytes`, SO_SNDBUF): a stream's
credit goes back when its chunk is handed to the socket, so an autotuned buffer (up to
tcp_wmem's 4 MiB) let a client that stopped reading take thousands of tokens without ever
being paused or reaching the slow-client timeout.

It also puts each request's uvicorn cycle in the ASGI scope (`CYCLE_SCOPE_KEY`): a streamed
response writes its chunks straight to the cycle's transport when that cannot block
(gateway/http/sse.py), which skips a coroutine and every middleware layer per chunk. And a
setter for a callback run when the connection is lost (`ON_LOST_SCOPE_KEY`): a stream learns
that its client left from it, without a task blocked on `receive()` for the whole stream.
Both entries close a reference cycle (the cycle and the setter hold the scope that holds
them), so they are taken out when the request's app returns, whichever layer answered it:
the request's objects then go by reference counting, not at the garbage collector's next
pass. Left in, a flood's 429s from gateway/http/early_shed.py (~14 objects each) made the
gateway's young collections ~20 ms pauses every few seconds, as long as the critical key's
first token waits behind them (issue 39).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_MAX_HEAD_BYTES = 64 * 1024  # request line and headers; h11's default is 16 KiB
CYCLE_SCOPE_KEY = "zeroserve.cycle"
ON_LOST_SCOPE_KEY = "zeroserve.on_connection_lost"  # set_on_lost(callback | None)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    send_buffer_bytes: int = 0  # 0: the kernel's autotuning

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.app = _untying_scope(self.app)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self.send_buffer_bytes:
            _cap_send_buffer(transport, self.send_buffer_bytes)
        self._head_timer: asyncio.TimerHandle | None = None
        self._on_lost: Callable[[], None] | None = None
        self._start_head()
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)
        on_lost, self._on_lost = self._on_lost, None
        if on_lost is not None:
            on_lost()

    def set_on_lost(self, callback: Callable[[], None] | None) -> None:
        """Run `callback` (once) when the connection is lost; None: no longer."""
        self._on_lost = callback

    def data_received(self, data: bytes) -> None:
        if self._is_reading_head and self._is_head_too_long(data):
            self._refuse_head()
            return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._is_reading_head = False
        self._cancel_head_timer()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade
            self.scope[CYCLE_SCOPE_KEY] = cycle
            self.scope[ON_LOST_SCOPE_KEY] = self.set_on_lost

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._start_head()  # what comes next on this connection is the next request's head

    # -- the head's size ---------------------------------------------------------------------

    def _start_head(self) -> None:
        self._is_reading_head = True
        self._num_head_bytes = 0
        self._head_tail = b""  # the last bytes seen, for a blank line split over two reads

    def _is_head_too_long(self, data: bytes) -> bool:
        """True when the head goes past max_head_bytes. One read may hold a head and the
        start of a body, so a long read is fine if the head's blank line is within budget."""
        budget = self.max_head_bytes - self._num_head_bytes
        self._num_head_bytes += len(data)
        window = self._head_tail + data[:max(budget, 0)]
        if b"\r\n\r\n" in window:
            self._is_reading_head = False  # the rest is a body; the parser takes it from here
            return False
        self._head_tail = window[-3:]
        return len(data) > budget

    # -- the timer --------------------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request head did not arrive within "
                             "%gs", self.header_timeout_s)
            self.transport.close()

    def _refuse_head(self) -> None:
        self._cancel_head_timer()
        self._is_reading_head = False
        if self.transport.is_closing():
            return
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                             b"content-length: 0\r\nconnection: close\r\n\r\n")
        self.transport.close()


ASGIApp = Callable[[dict, Any, Any], Awaitable[None]]


def _untying_scope(app: ASGIApp) -> ASGIApp:
    """`app`, then our entries out of the request's scope (the module's docstring)."""

    async def app_then_untie(scope: dict, receive: Any, send: Any) -> None:
        try:
            await app(scope, receive, send)
        finally:
            scope.pop(CYCLE_SCOPE_KEY, None)
            scope.pop(ON_LOST_SCOPE_KEY, None)

    return app_then_untie


def _cap_send_buffer(transport: asyncio.Transport, num_bytes: int) -> None:
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, num_bytes)
    except OSError:  # the connection is already gone: nothing to bound
        pass


def guarded_protocol(header_timeout_s: float, send_buffer_bytes: int = 0,
                     max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES) -> type[GuardedHttpToolsProtocol]:
    """The protocol class to pass as uvicorn.Config(http=...), with these limits."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,),
                {"header_timeout_s": header_timeout_s, "max_head_bytes": max_head_bytes,
                 "send_buffer_bytes": send_buffer_bytes})
