"""Liveness, readiness and the detailed /health, against the real app with fake workers."""

from __future__ import annotations

import os
import time

import httpx

from tests.gateway.helpers import GatewayServer, wait_until


def test_live_without_workers_ready_only_with_one():
    with GatewayServer() as gw:
        for path in ("/health/live", "/livez"):
            r = httpx.get(gw.url + path)
            # The gateway runs in this process (a thread): its pid is ours.
            assert r.status_code == 200 and r.json() == {"status": "ok", "pid": os.getpid()}
        for path in ("/health/ready", "/readyz", "/health"):
            assert httpx.get(gw.url + path).status_code == 503, path
        assert httpx.get(gw.url + "/health/ready").json()["num_ready_workers"] == 0

        worker = gw.worker().start()
        assert worker.ready.wait(5)
        try:
            for path in ("/health/live", "/livez", "/health/ready", "/readyz", "/health"):
                assert httpx.get(gw.url + path).status_code == 200, path
            assert httpx.get(gw.url + "/readyz").json() == {"status": "ready",
                                                             "num_ready_workers": 1}
        finally:
            worker.stop()
        # The worker is gone (no heartbeat): not ready, still live.
        assert wait_until(lambda: httpx.get(gw.url + "/readyz").status_code == 503, 5)
        assert httpx.get(gw.url + "/livez").status_code == 200


def test_health_reports_a_loop_stall():
    with GatewayServer(loop_lag_warn_s=0.2) as gw:
        lag = httpx.get(gw.url + "/health").json()["event_loop_lag"]
        assert lag["num_stalls"] == 0 and lag["p50_ms"] < 50
        assert lag["stall_threshold_ms"] == 200
        gw.loop.call_soon_threadsafe(time.sleep, 0.4)  # a callback that holds the loop

        def stalled() -> bool:
            lag = httpx.get(gw.url + "/health").json()["event_loop_lag"]
            return lag["num_stalls"] == 1 and lag["max_ms"] >= 300
        assert wait_until(stalled, 5)
