"""A streamed response's head, held back to go out in the same write as its first chunk.

A stream's head (status line and headers) used to be a write of its own, then its first
event another. Each write to a socket is a system call, and on loopback the kernel's TCP
work for the receiving side too: at 1,000 streams opened at once (issue 36) the head's own
write was about a twentieth of the gateway's CPU per admitted request.

How: for the `http.response.start` message, this object stands in for the connection's
transport in uvicorn's request cycle (gateway/http/http_protocol.py puts the cycle in the
scope). The start message goes through every middleware as before (CORS adds its headers),
uvicorn builds the head as before and "writes" it here, where it is held. The next write of
the response, whoever makes it (uvicorn's `send` for a body message, or the direct path's
`write`), goes out as head + that write in one `write` to the real transport, and the cycle
has its real transport back. So the bytes on the wire are the same, in the same order.

A stream with nothing to send soon (a long prefill, a queue) does not keep its client
waiting for the head: `flush` (called `HEAD_HOLD_S` after the start) writes it alone.
"""

from __future__ import annotations

import asyncio
from typing import Any

# The longest a head waits for the stream's first chunk.
HEAD_HOLD_S = 1.0


class HeldHead:
    """Installed as `cycle.transport` by `hold(cycle)`; gone again at the first write."""

    def __init__(self, cycle: Any) -> None:
        self.cycle = cycle
        self.transport = cycle.transport  # the real one
        self.head: bytes | None = None  # uvicorn's head, once it has written it here
        self.timer: asyncio.TimerHandle | None = None
        cycle.transport = self

    def write(self, data: bytes) -> None:
        if self.head is None:
            self.head = bytes(data)  # the response's start: held
            return
        self._release()
        self.transport.write(self.head + data)

    def flush(self) -> None:
        """Write the head now, alone, if it is still held."""
        if self.cycle.transport is self:
            self._release()
            if self.head and not self.transport.is_closing():
                self.transport.write(self.head)

    def drop(self) -> None:
        """Give the cycle its transport back, writing nothing (the response is over)."""
        if self.cycle.transport is self:
            self._release()

    def close(self) -> None:
        self.drop()
        self.transport.close()

    def _release(self) -> None:
        self.cycle.transport = self.transport
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, ...
        return getattr(self.transport, name)


async def start_held(cycle: Any, send: Any, message: dict,
                     loop: asyncio.AbstractEventLoop) -> HeldHead | None:
    """Send `message` (http.response.start) with its head held (see the module docstring);
    None when nothing was held (uvicorn wrote nothing: the client had gone)."""
    held = HeldHead(cycle)
    try:
        await send(message)
    finally:
        if held.head is None:
            held.drop()
    if held.head is None:
        return None
    held.timer = loop.call_later(HEAD_HOLD_S, held.flush)
    return held
