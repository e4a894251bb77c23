"""Admissions before relay: while a burst of requests comes in, the relay of the running
streams waits (up to --admission-hold at a time, at most half the time) so the burst gets in
first (gateway/workers/zmq_io.py, ZmqEdge._hold_for_admissions; Gateway.is_admitting)."""

from __future__ import annotations

import asyncio
import time

import pytest

from zeroserve.gateway.config import GatewayConfig
from zeroserve.gateway.core import ADMISSION_GAP_S, Gateway
from zeroserve.gateway.streams import Sink
from zeroserve.gateway.workers.zmq_io import ZmqEdge


def edge(admitting, limit_s: float = 0.05) -> ZmqEdge:
    e = ZmqEdge("ipc:///nonexistent/router", "ipc:///nonexistent/tokens", lambda p, m: None)
    e.admitting, e.max_admission_hold_s = admitting, limit_s
    return e


async def held_s(e: ZmqEdge) -> float:
    started = time.monotonic()
    await e._hold_for_admissions()
    return time.monotonic() - started


def test_a_burst_holds_the_relay_for_at_most_the_limit_and_half_the_time():
    async def scenario():
        e = edge(lambda: True)
        first = await held_s(e)
        right_after = await held_s(e)  # the relay has not run as long as the hold yet
        await asyncio.sleep(first)  # ... now it has
        again = await held_s(e)
        return first, right_after, again

    first, right_after, again = asyncio.run(scenario())
    assert 0.05 <= first < 0.5
    assert right_after < 0.01
    assert 0.05 <= again < 0.5


def test_the_hold_ends_when_requests_stop_coming():
    async def scenario():
        until = time.monotonic() + 0.01
        return await held_s(edge(lambda: time.monotonic() < until, limit_s=0.5))

    assert asyncio.run(scenario()) < 0.2


@pytest.mark.parametrize("admitting, limit_s", [(lambda: False, 0.05), (lambda: True, 0.0),
                                                (None, 0.05)])
def test_no_burst_or_no_limit_holds_nothing(admitting, limit_s):
    assert asyncio.run(held_s(edge(admitting, limit_s))) < 0.01


def test_the_gateway_is_admitting_while_requests_come_close_together():
    now = [100.0]
    gateway = Gateway(GatewayConfig(port=1), clock=lambda: now[0])
    assert gateway.edge.max_admission_hold_s == GatewayConfig().admission_hold_s > 0
    assert not gateway.is_admitting()
    gateway.new_request(0, [1], Sink())
    assert gateway.is_admitting()
    now[0] += 2 * ADMISSION_GAP_S
    assert not gateway.is_admitting()
    gateway.new_request(0, [1], Sink())
    assert gateway.is_admitting()


def test_the_limit_is_checked():
    with pytest.raises(ValueError, match="admission_hold_s"):
        GatewayConfig(admission_hold_s=-0.1)
    with pytest.raises(ValueError, match="admission_hold_s"):
        GatewayConfig(admission_hold_s=5)
