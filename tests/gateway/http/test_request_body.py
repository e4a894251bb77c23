"""Reading a request's body (gateway/http/request_body.py): a body that has wholly arrived is
read at once, without arming the body timeout's timer; one still arriving is read under it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from zeroserve.gateway.errors import APIError
from zeroserve.gateway.http import request_body
from zeroserve.gateway.http.http_protocol import CYCLE_SCOPE_KEY
from zeroserve.gateway.http.request_body import read_body


def request_with(messages: list[dict], *, more_body: bool, content_length: int | None = None
                 ) -> Request:
    """A request whose uvicorn cycle says whether the body is all in (`more_body` False and
    its message event set, as uvicorn leaves it after the message is complete)."""
    headers = [(b"content-type", b"application/json")]
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    event = asyncio.Event()
    event.set()
    cycle = SimpleNamespace(more_body=more_body, message_event=event, disconnected=False)
    pending = list(messages)

    async def receive():
        if pending:
            return pending.pop(0)
        await asyncio.Event().wait()  # the rest never comes

    return Request({"type": "http", "method": "POST", "headers": headers,
                    CYCLE_SCOPE_KEY: cycle}, receive)


@pytest.fixture
def timers(monkeypatch):
    """The body timeouts read_body arms."""
    armed = []
    original = asyncio.timeout

    def counting(delay):
        armed.append(delay)
        return original(delay)

    monkeypatch.setattr(request_body.asyncio, "timeout", counting)
    return armed


def test_a_body_that_has_arrived_is_read_without_a_timer(timers):
    body = b'{"prompt": "hi"}'
    request = request_with([{"type": "http.request", "body": body, "more_body": False}],
                           more_body=False, content_length=len(body))
    assert asyncio.run(read_body(request, 1024, 5.0)) == body
    assert timers == []


def test_a_body_that_has_arrived_still_has_the_size_limit(timers):
    # No Content-Length (chunked): only the bytes read can show it is too large.
    request = request_with([{"type": "http.request", "body": b"x" * 2000, "more_body": False}],
                           more_body=False)
    with pytest.raises(APIError) as e:
        asyncio.run(read_body(request, 1024, 5.0))
    assert e.value.status == 413


def test_a_body_still_arriving_is_read_under_the_timeout(timers):
    parts = [{"type": "http.request", "body": b'{"a":', "more_body": True},
             {"type": "http.request", "body": b' 1}', "more_body": False}]
    assert asyncio.run(read_body(request_with(parts, more_body=True), 1024, 5.0)) == b'{"a": 1}'
    with pytest.raises(APIError) as e:  # the rest of this one never arrives
        asyncio.run(read_body(request_with(parts[:1], more_body=True), 1024, 0.05))
    assert e.value.status == 408
    assert timers == [5.0, 0.05]


def test_a_client_gone_during_the_body_is_499(timers):
    request = request_with([{"type": "http.disconnect"}], more_body=True)
    with pytest.raises(APIError) as e:
        asyncio.run(read_body(request, 1024, 5.0))
    assert e.value.status == 499
