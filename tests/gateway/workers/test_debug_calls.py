"""DebugCalls: a DEBUG_REPLY resolves only its own call, from the worker asked; what the
worker refused keeps its meaning as an HTTP status; silence is a 504, no route a 404."""

from __future__ import annotations

import asyncio

import pytest

from zeroserve.common.protocol import DebugReply, DebugRequest
from zeroserve.gateway.errors import APIError
from zeroserve.gateway.workers.debug_calls import MAX_PENDING, DebugCalls


class Wire:
    def __init__(self, connected: bool = True):
        self.sent: list[tuple[str, DebugRequest]] = []
        self.connected = connected

    def send(self, worker_id: str, msg) -> bool:
        self.sent.append((worker_id, msg))
        return self.connected


async def answered(calls: DebugCalls, wire: Wire, reply_from: str, **reply) -> dict:
    call = asyncio.create_task(calls.call("w0", "stacks", {}, 2.0))
    await asyncio.sleep(0)
    worker_id, request = wire.sent[-1]
    assert worker_id == "w0" and request.kind == "stacks"
    calls.on_reply(reply_from, DebugReply(request.token, **reply))
    return await call


def test_a_reply_resolves_its_call():
    wire = Wire()
    calls = DebugCalls(wire.send)
    result = asyncio.run(answered(calls, wire, "w0", ok=True, result={"threads": []}))
    assert result == {"threads": []}


def test_a_reply_from_another_worker_or_with_another_token_is_dropped():
    async def scenario():
        wire = Wire()
        calls = DebugCalls(wire.send)
        call = asyncio.create_task(calls.call("w0", "stacks", {}, 0.3))
        await asyncio.sleep(0)
        token = wire.sent[-1][1].token
        calls.on_reply("w1", DebugReply(token, True, {"forged": True}))
        calls.on_reply("w0", DebugReply("other", True, {"forged": True}))
        with pytest.raises(APIError) as e:
            await call
        return e.value
    error = asyncio.run(scenario())
    assert error.status == 504 and error.code == "worker_timeout"


@pytest.mark.parametrize("code, status", [("busy", 409), ("bad_args", 400), ("timeout", 504),
                                          ("failed", 502)])
def test_a_refusal_keeps_its_meaning(code, status):
    wire = Wire()
    calls = DebugCalls(wire.send)
    with pytest.raises(APIError) as e:
        asyncio.run(answered(calls, wire, "w0", ok=False, error="no", code=code))
    assert e.value.status == status and e.value.code == f"debug_{code}"


def test_an_unconnected_worker_is_a_404_and_calls_are_bounded():
    async def scenario():
        calls = DebugCalls(Wire(connected=False).send)
        with pytest.raises(APIError) as e:
            await calls.call("gone", "stacks", {}, 1.0)
        assert e.value.status == 404
        busy = DebugCalls(Wire().send)
        waiting = [asyncio.create_task(busy.call("w0", "stacks", {}, 5.0))
                   for _ in range(MAX_PENDING)]
        await asyncio.sleep(0)
        with pytest.raises(APIError) as e:
            await busy.call("w0", "stacks", {}, 1.0)
        assert e.value.status == 429
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
    asyncio.run(scenario())


def test_at_shutdown_every_waiting_call_ends_with_the_error_given():
    async def scenario():
        calls = DebugCalls(Wire().send)
        ended: list[bool] = []
        calls.on_end.append(lambda: ended.append(True))
        call = asyncio.create_task(calls.call("w0", "profile", {}, 60.0))
        await asyncio.sleep(0)
        calls.end_all(APIError(503, "The server is shutting down.", code="shutdown"))
        with pytest.raises(APIError) as e:
            await call
        return e.value, ended
    error, ended = asyncio.run(scenario())
    assert error.status == 503 and error.code == "shutdown" and ended == [True]
