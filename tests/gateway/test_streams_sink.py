"""The request group's inbox (gateway/streams.py Sink): what the receive loop puts, the
handler takes, in order, waking it once per put; a handler that stops waiting loses nothing."""

from __future__ import annotations

import asyncio

import pytest

from zeroserve.gateway.streams import Sink


def test_items_come_out_in_order_and_get_waits_for_a_put():
    async def main():
        sink = Sink()
        getter = asyncio.ensure_future(sink.get())
        await asyncio.sleep(0)
        assert not getter.done()  # nothing there yet: it waits
        sink.put_nowait("a")
        sink.put_nowait("b")
        assert await asyncio.wait_for(getter, 1) == "a"
        assert not sink.empty() and sink.qsize() == 1
        assert sink.get_nowait() == "b"
        assert sink.empty()
        with pytest.raises(asyncio.QueueEmpty):
            sink.get_nowait()

    asyncio.run(main())


def test_a_cancelled_get_loses_nothing():
    async def main():
        sink = Sink()
        getter = asyncio.ensure_future(sink.get())
        await asyncio.sleep(0)
        getter.cancel()
        await asyncio.gather(getter, return_exceptions=True)
        sink.put_nowait("kept")  # the cancelled waiter is skipped
        assert await asyncio.wait_for(sink.get(), 1) == "kept"

    asyncio.run(main())
