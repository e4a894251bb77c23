"""How a streamed response ends: its last chunk ends the body in the same send, and a lost
connection stops it through our protocol's callback (no task waiting on `receive()`); a
client that closes right after the end is no disconnect."""

from __future__ import annotations

import asyncio
import types

from zeroserve.gateway.http.http_protocol import CYCLE_SCOPE_KEY, ON_LOST_SCOPE_KEY
from zeroserve.gateway.http.sse import LastChunk, SSEResponse


def cycle() -> types.SimpleNamespace:
    """What SSEResponse reads of uvicorn's RequestResponseCycle."""
    transport = types.SimpleNamespace(is_closing=lambda: False, write=lambda data: None)
    return types.SimpleNamespace(response_started=True, chunked_encoding=True,
                                 disconnected=False, transport=transport,
                                 flow=types.SimpleNamespace(write_paused=False))


class Client:
    """The ASGI side: records sends; `receive` must not be needed behind our protocol."""

    def __init__(self) -> None:
        self.bodies: list[tuple[bytes, bool]] = []
        self.on_lost = None
        self.num_receives = 0
        self.num_disconnects = 0
        self.close_after_end = False  # the client closes as soon as it reads the end

    def scope(self) -> dict:
        return {CYCLE_SCOPE_KEY: cycle(), ON_LOST_SCOPE_KEY: self.set_on_lost}

    def set_on_lost(self, callback) -> None:
        self.on_lost = callback

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.body":
            self.bodies.append((message["body"], message["more_body"]))
            if not message["more_body"] and self.close_after_end and self.on_lost:
                asyncio.get_running_loop().call_soon(self.on_lost)

    async def receive(self) -> dict:
        self.num_receives += 1
        await asyncio.Event().wait()
        return {}

    def response(self, events) -> SSEResponse:
        def disconnected() -> None:
            self.num_disconnects += 1

        return SSEResponse(events, 5.0, on_slow_client=lambda: b"", on_disconnect=disconnected)


def test_the_last_chunk_ends_the_response_in_the_same_send():
    client = Client()
    client.close_after_end = True

    async def events():
        yield b"data: 1\n\n"
        yield LastChunk(b"data: [DONE]\n\n")

    async def main() -> None:
        await asyncio.wait_for(client.response(events())(client.scope(), client.receive,
                                                         client.send), 5)
        await asyncio.sleep(0.01)  # the close lands after the response returned, too

    asyncio.run(main())
    assert client.bodies == [(b"data: 1\n\n", True), (b"data: [DONE]\n\n", False)]
    assert client.num_disconnects == 0 and client.num_receives == 0
    assert client.on_lost is None  # the callback is taken back at the end


def test_a_lost_connection_stops_the_stream_and_its_work():
    client = Client()
    state = {"cleaned_up": False}

    async def events():
        try:
            yield b"data: 1\n\n"
            await asyncio.Event().wait()  # waiting on the engine
            yield LastChunk(b"never")
        finally:
            state["cleaned_up"] = True  # where the real source aborts its engine requests

    async def main() -> None:
        call = asyncio.ensure_future(client.response(events())(
            client.scope(), client.receive, client.send))
        await asyncio.sleep(0.05)
        assert not call.done() and client.on_lost is not None
        client.on_lost()  # the protocol's connection_lost
        await asyncio.wait_for(call, 5)

    asyncio.run(main())
    assert state["cleaned_up"]
    assert client.num_disconnects == 1 and client.num_receives == 0
    assert client.bodies == [(b"data: 1\n\n", True)]  # no end written to a gone client


def test_without_our_protocol_the_end_is_no_disconnect_either():
    """Any other server: a watcher task reads `receive()`, which says http.disconnect once
    the response is complete; that must not count as the client leaving."""
    client = Client()
    state = {"ended": None}

    async def send(message: dict) -> None:
        await client.send(message)
        if message["type"] == "http.response.body" and not message["more_body"]:
            state["ended"].set()

    async def receive() -> dict:
        await state["ended"].wait()
        return {"type": "http.disconnect"}

    async def events():
        yield LastChunk(b"data: [DONE]\n\n")

    async def main() -> None:
        state["ended"] = asyncio.Event()
        await asyncio.wait_for(client.response(events())({}, receive, send), 5)

    asyncio.run(main())
    assert client.bodies == [(b"data: [DONE]\n\n", False)] and client.num_disconnects == 0


def test_a_stream_looks_up_its_loop_once(monkeypatch):
    """(On Python 3.11 each lookup of the running loop is a getpid() system call.)"""
    client = Client()
    lookups = []
    get_running_loop = asyncio.get_running_loop

    def counting():
        lookups.append(1)
        return get_running_loop()

    async def events():
        yield b"data: 1\n\n"
        yield LastChunk(b"data: [DONE]\n\n")

    async def main() -> None:
        response = client.response(events())
        monkeypatch.setattr(asyncio, "get_running_loop", counting)
        try:
            await response(client.scope(), client.receive, client.send)
        finally:
            monkeypatch.undo()

    asyncio.run(main())
    assert client.bodies == [(b"data: 1\n\n", True), (b"data: [DONE]\n\n", False)]
    assert len(lookups) == 1
