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
        assert lag["stall_threshold_ms"] == 200
        num_before = lag["num_stalls"]  # 0 on an idle machine; a loaded one may have stalled
        gw.loop.call_soon_threadsafe(time.sleep, 0.4)  # a callback that holds the loop

        def stalled() -> bool:
            lag = httpx.get(gw.url + "/health").json()["event_loop_lag"]
            return lag["num_stalls"] > num_before and lag["max_ms"] >= 300
        assert wait_until(stalled, 5)


def test_a_lost_worker_is_listed_with_its_pid_until_it_comes_back():
    """`serve`'s supervisor learns from /health which local process went silent (its pid) so
    it can replace it (cli/children.py GatewayWorkerWatch)."""
    from zeroserve.cli.children import GatewayWorkerWatch

    with GatewayServer() as gw:
        worker = gw.worker(worker_id="w0").start()
        assert worker.ready.wait(5)
        watch = GatewayWorkerWatch(gw.url)
        assert watch({"w0": worker.pid}) == set()
        worker.is_heartbeating = False  # SIGSTOPped, as the gateway sees it
        assert wait_until(lambda: httpx.get(gw.url + "/health").json()["lost_workers"], 5)
        lost = httpx.get(gw.url + "/health").json()["lost_workers"]
        assert [(w["worker_id"], w["pid"]) for w in lost] == [("w0", worker.pid)]
        assert watch({"w0": worker.pid}) == {"w0"}
        assert watch({"w0": worker.pid + 1}) == set()  # another incarnation: not condemned
        worker.stop()
        back = gw.worker(worker_id="w0").start()
        assert back.ready.wait(5)
        assert httpx.get(gw.url + "/health").json()["lost_workers"] == []
        back.stop()
