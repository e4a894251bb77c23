"""An in-process CPU profile of the gateway, for finding where its time goes.

`ZEROSERVE_GATEWAY_CPU_PROFILE=PATH` (read by `zeroserve gateway` at start) runs the gateway
under cProfile and writes the stats to PATH when it shuts down (`python -m pstats PATH`).
With `serve --gateways N` gateway i > 0 writes `PATH.<i>`. It is a debugging aid: cProfile
roughly doubles the cost of Python calls, so figures from a profiled run are shares, not
times. The clock is the loop thread's CPU time, not the wall: on a shared machine a call
during which the process was descheduled, or waited for the GIL, is not charged for it.
Without the variable nothing is profiled and nothing is added to any path.
"""

from __future__ import annotations

import cProfile
import os
import time

from zeroserve.gateway.logging import get_logger

ENV_VAR = "ZEROSERVE_GATEWAY_CPU_PROFILE"
log = get_logger("cpu_profile")


class CpuProfile:
    """cProfile over the calls made on the thread that starts it (the event loop's)."""

    def __init__(self, path: str):
        self.path = path
        self._profiler: cProfile.Profile | None = None

    @classmethod
    def from_env(cls, gateway_index: int = 0) -> CpuProfile | None:
        """The profile the environment asks for; None: not profiled."""
        path = os.environ.get(ENV_VAR) or None
        if path is None:
            return None
        return cls(f"{path}.{gateway_index}" if gateway_index else path)

    def start(self) -> None:
        self._profiler = cProfile.Profile(time.thread_time)
        self._profiler.enable()

    def stop(self) -> None:
        """Write the stats (once). Called as the server shuts down: uvicorn then re-raises
        the signal that stopped it, so nothing after its run() would get to write them."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        profiler.disable()
        profiler.dump_stats(self.path)
        log.warning("CPU profile written to %s", self.path)
