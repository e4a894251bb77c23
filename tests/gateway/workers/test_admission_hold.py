"""Admissions before relay: while a burst of requests comes in, the relay of the running
streams waits (up to --admission-hold at a time, at most half the time) so the burst gets in
first (gateway/workers/zmq_io.py, ZmqEdge._hold_for_admissions; Gateway.is_admitting)."""

from __future__ import annotations

import asyncio

import pytest

from zeroserve.gateway.config import GatewayConfig
from zeroserve.gateway.core import ADMISSION_GAP_S, Gateway
from zeroserve.gateway.streams import Sink
from zeroserve.gateway.workers import zmq_io
from zeroserve.gateway.workers.zmq_io import ZmqEdge


class FakeClock:
    """The edge's clock and its naps: a nap moves the time on by exactly its length, so the
    hold's arithmetic is checked to the nap whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(zmq_io, "time", clock)
    monkeypatch.setattr(zmq_io, "asyncio", _AsyncioWith(clock.sleep))
    return clock


class _AsyncioWith:
    """zmq_io's view of asyncio with another sleep (asyncio's own stays untouched)."""

    def __init__(self, sleep) -> None:
        self.sleep = sleep

    def __getattr__(self, name: str):
        return getattr(asyncio, name)


def edge(admitting, limit_s: float = 0.05) -> ZmqEdge:
    e = ZmqEdge("ipc:///nonexistent/router", "ipc:///nonexistent/tokens", lambda p, m: None)
    e.admitting, e.max_admission_hold_s = admitting, limit_s
    return e


def held_s(e: ZmqEdge, clock: FakeClock) -> float:
    started = clock.now
    asyncio.run(e._hold_for_admissions())
    return clock.now - started


def test_a_burst_holds_the_relay_for_at_most_the_limit_and_half_the_time(clock):
    e = edge(lambda: True)
    first = held_s(e, clock)
    right_after = held_s(e, clock)  # the relay has not run as long as the hold yet
    clock.now += first  # ... now it has
    again = held_s(e, clock)
    nap = zmq_io._ADMISSION_NAP_S
    assert 0.05 <= first < 0.05 + nap
    assert right_after == 0
    assert 0.05 <= again < 0.05 + nap


def test_the_hold_ends_when_requests_stop_coming(clock):
    until = clock.now + 0.01
    assert held_s(edge(lambda: clock.now < until, limit_s=0.5), clock) < 0.01 + 0.01


@pytest.mark.parametrize("admitting, limit_s", [(lambda: False, 0.05), (lambda: True, 0.0),
                                                (None, 0.05)])
def test_no_burst_or_no_limit_holds_nothing(admitting, limit_s, clock):
    assert held_s(edge(admitting, limit_s), clock) == 0


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
