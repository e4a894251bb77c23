"""The request group's inbox (gateway/streams.py Sink): what the receive loop puts, the
handler takes, in order, all that is queued at once; a handler that stops waiting loses
nothing."""

from __future__ import annotations

import asyncio

from zeroserve.gateway.streams import Sink


def test_items_come_out_in_order_and_get_batch_waits_for_a_put():
    async def main():
        sink = Sink()
        getter = asyncio.ensure_future(sink.get_batch())
        await asyncio.sleep(0)
        assert not getter.done()  # nothing there yet: it waits
        sink.put_nowait("a")
        sink.put_nowait("b")
        assert await asyncio.wait_for(getter, 1) == ["a", "b"]
        getter = asyncio.ensure_future(sink.get_batch())  # everything was taken: it waits
        await asyncio.sleep(0)
        assert not getter.done()
        sink.wake()  # woken with nothing new
        assert await asyncio.wait_for(getter, 1) == []

    asyncio.run(main())


def test_a_cancelled_get_batch_loses_nothing():
    async def main():
        sink = Sink()
        getter = asyncio.ensure_future(sink.get_batch())
        await asyncio.sleep(0)
        getter.cancel()
        await asyncio.gather(getter, return_exceptions=True)
        sink.put_nowait("kept")  # the cancelled waiter is skipped
        assert await asyncio.wait_for(sink.get_batch(), 1) == ["kept"]

    asyncio.run(main())


def test_the_direct_hook_takes_items_only_while_the_consumer_waits_on_nothing():
    async def main():
        taken: list = []
        sink = Sink()
        sink.direct = lambda item: taken.append(item) or True
        sink.put_nowait("queued")  # no consumer parked: queued
        assert await sink.get_batch() == ["queued"] and taken == []
        getter = asyncio.ensure_future(sink.get_batch())
        await asyncio.sleep(0)
        sink.put_nowait("direct")  # parked on an empty sink: handled then and there
        assert taken == ["direct"] and not getter.done()
        sink.direct = lambda item: False  # the hook declines: the consumer gets it
        sink.put_nowait("declined")
        assert await asyncio.wait_for(getter, 1) == ["declined"]

    asyncio.run(main())


def test_a_consumer_waiting_again_and_again_looks_up_its_loop_once(monkeypatch):
    """(On Python 3.11 each lookup of the running loop is a getpid() system call: the sink
    waits once per engine step of a stream.)"""
    lookups = []
    get_running_loop = asyncio.get_running_loop

    def counting():
        lookups.append(1)
        return get_running_loop()

    async def main():
        sink = Sink()
        monkeypatch.setattr(asyncio, "get_running_loop", counting)
        for k in range(5):
            getter = asyncio.ensure_future(sink.get_batch())
            await asyncio.sleep(0)
            sink.put_nowait(k)
            assert await getter == [k]
        monkeypatch.undo()

    asyncio.run(main())
    assert len(lookups) == 1
