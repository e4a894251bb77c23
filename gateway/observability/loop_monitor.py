"""Event-loop lag: how late a task that asks to wake every `interval_s` actually wakes.

Everything on the gateway's loop (every stream, the ZeroMQ receive loop, the heartbeats it
sends) waits while one callback runs, so the loop's lateness is the latency every client
pays on top of the model. One task per process samples it; nothing is added per request.

- `lag = woke_at - (slept_at + interval_s)`: 0 on an idle loop; a callback that holds the
  loop for 2 s shows as one sample of about 2 s when the loop comes back.
- The last `window_size` samples (a minute at the default interval) give p50/p99/max; stalls
  (samples at or above `warn_s`) are counted since start.
- A stall logs a warning, at most one per `log_every_s`; the stalls it did not log are
  counted in the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

from zeroserve.gateway.logging import get_logger

log = get_logger("loop_monitor")

DEFAULT_INTERVAL_S = 0.05
DEFAULT_WINDOW_SIZE = 1200  # one minute of samples at 50 ms
DEFAULT_LOG_EVERY_S = 10.0


class LoopLagMonitor:
    def __init__(self, warn_s: float, interval_s: float = DEFAULT_INTERVAL_S,
                 window_size: int = DEFAULT_WINDOW_SIZE, log_every_s: float = DEFAULT_LOG_EVERY_S,
                 clock: Callable[[], float] | None = None):
        if warn_s <= 0 or interval_s <= 0 or window_size < 1:
            raise ValueError("warn_s and interval_s must be > 0, window_size >= 1")
        self.warn_s = warn_s
        self.interval_s = interval_s
        self.log_every_s = log_every_s
        self.samples: deque[float] = deque(maxlen=window_size)  # seconds late, oldest first
        self.num_samples = 0
        self.num_stalls = 0
        self.lag_sum_s = 0.0  # since start
        self.max_lag_s = 0.0  # since start
        self._clock = clock
        self._last_log_at: float | None = None
        self._num_unlogged = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._clock = self._clock or loop.time
        self._task = loop.create_task(self._run(), name="loop-lag-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            due = self._clock() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.record(max(0.0, self._clock() - due))

    def record(self, lag_s: float) -> None:
        self.samples.append(lag_s)
        self.num_samples += 1
        self.lag_sum_s += lag_s
        self.max_lag_s = max(self.max_lag_s, lag_s)
        if lag_s < self.warn_s:
            return
        self.num_stalls += 1
        now = self._clock()
        if self._last_log_at is not None and now - self._last_log_at < self.log_every_s:
            self._num_unlogged += 1
            return
        log.warning("event loop stalled", extra={
            "lag_s": round(lag_s, 3), "warn_s": self.warn_s,
            "num_stalls_not_logged": self._num_unlogged, "num_stalls": self.num_stalls})
        self._last_log_at = now
        self._num_unlogged = 0

    def describe(self) -> dict:
        """For /health: quantiles over the window (in milliseconds) and counts since start."""
        ordered = sorted(self.samples)

        def quantile(q: float) -> float:
            if not ordered:
                return 0.0
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        window_s = len(ordered) * self.interval_s
        return {
            "p50_ms": round(quantile(0.50) * 1000, 2),
            "p99_ms": round(quantile(0.99) * 1000, 2),
            "max_ms": round((ordered[-1] if ordered else 0.0) * 1000, 2),
            "max_ms_since_start": round(self.max_lag_s * 1000, 2),
            "window_s": round(window_s, 1),
            "num_samples": self.num_samples,
            "num_stalls": self.num_stalls,
            "stall_threshold_ms": round(self.warn_s * 1000, 1),
        }
