"""The event-loop lag monitor: samples, quantiles, stall counting and rate-limited warnings."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from zeroserve.gateway.observability.loop_monitor import LoopLagMonitor


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_quantiles_over_a_bounded_window():
    monitor = LoopLagMonitor(warn_s=1.0, window_size=100, clock=Clock())
    for lag_ms in range(200):  # the first 100 fall out of the window
        monitor.record(lag_ms / 1000)
    described = monitor.describe()
    assert len(monitor.samples) == 100 and described["num_samples"] == 200
    assert described["p50_ms"] == 150 and described["p99_ms"] == 199
    assert described["max_ms"] == 199 and described["num_stalls"] == 0


def test_an_empty_window_reads_zero():
    described = LoopLagMonitor(warn_s=0.25).describe()
    assert described["p50_ms"] == described["p99_ms"] == described["max_ms"] == 0


def test_stalls_are_counted_always_and_logged_at_most_once_per_period(caplog):
    clock = Clock()
    monitor = LoopLagMonitor(warn_s=0.25, log_every_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="zeroserve.gateway.observability.loop_monitor"):
        for second in range(25):
            clock.now = float(second)
            monitor.record(0.5)
            monitor.record(0.01)
    warnings = [r for r in caplog.records if r.getMessage() == "event loop stalled"]
    assert monitor.num_stalls == 25
    assert len(warnings) == 3  # at 0 s, 10 s and 20 s
    assert warnings[1].num_stalls_not_logged == 9  # the ones at 1..9 s
    assert monitor.describe()["max_ms_since_start"] == 500


def test_the_task_measures_a_blocked_loop():
    async def scenario() -> dict:
        monitor = LoopLagMonitor(warn_s=0.1, interval_s=0.02)
        monitor.start()
        await asyncio.sleep(0.1)
        time.sleep(0.3)  # hold the loop
        await asyncio.sleep(0.1)
        await monitor.stop()
        return monitor.describe()

    described = asyncio.run(scenario())
    assert described["num_stalls"] == 1
    assert 250 <= described["max_ms"] < 1000
    assert described["p50_ms"] < 50


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        LoopLagMonitor(warn_s=0)
