"""Two live processes with one worker id (a copied key, a misconfiguration): the gateway
keeps the first and refuses the second until the first is gone, on real sockets."""

from __future__ import annotations

import signal
import subprocess
import threading

import httpx
import pytest

from tests.gateway.helpers import GatewayServer, cyclic_reply, wait_until
from zeroserve.cli.harness import REPO_ROOT, child_env, zeroserve_argv


def test_a_second_live_process_with_the_same_id_is_refused_until_the_first_is_gone():
    with GatewayServer() as gw:
        first = gw.worker(worker_id="w0", reply=cyclic_reply("ab"), step_s=0.01).start()
        assert first.ready.wait(5)
        result = {}
        client = threading.Thread(target=lambda: result.update(r=httpx.post(
            gw.url + "/v1/completions", timeout=20,
            json={"prompt": "x", "max_tokens": 150})))
        client.start()
        assert wait_until(lambda: first.submits, 5)
        second = gw.worker(worker_id="w0", reply=cyclic_reply("ab")).start()
        assert not second.ready.wait(1.0)  # refused while the first lives
        client.join(20)
        # The first kept its place and its stream: no failover to the second, no restart.
        assert result["r"].status_code == 200
        assert result["r"].json()["choices"][0]["text"] == "ab" * 75
        assert len(first.submits) == 1 and not second.submits
        assert gw.gateway.registry.get("w0").hello.pid == first.pid
        first.stop()  # the first process is gone: the second's next HELLO is taken
        second.send_control(second.hello())
        assert second.ready.wait(5)
        r = httpx.post(gw.url + "/v1/completions", timeout=10,
                       json={"prompt": "x", "max_tokens": 4})
        assert r.json()["choices"][0]["text"] == "abab"
        assert gw.gateway.registry.get("w0").hello.pid == second.pid
        second.stop()


@pytest.mark.slow
def test_real_workers_sharing_an_id_take_turns_only_when_one_dies():
    """Two real worker processes with one id: the second is refused (it keeps running and
    saying HELLO) while the first lives, and is taken within seconds once the first is
    killed; meanwhile the first's requests are never failed over."""
    with GatewayServer(worker_timeout_s=1.0) as gw:
        refusals = _count_duplicate_refusals(gw)
        first = _start_worker(gw, "w0")
        second = None
        try:
            assert wait_until(lambda: _pid_of(gw, "w0") == first.pid, 60)
            second = _start_worker(gw, "w0")
            # Its start-up, then several HELLOs, each refused (polled, not a fixed wait).
            assert wait_until(lambda: refusals.count(second.pid) >= 3, 60), refusals
            assert second.poll() is None  # refused, not ended
            assert _pid_of(gw, "w0") == first.pid
            # No incarnation replaced another (each replacement fails over every stream).
            assert 'event="restarted"' not in httpx.get(gw.url + "/metrics").text
            r = httpx.post(gw.url + "/v1/completions", timeout=30,
                           json={"prompt": "x", "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            assert wait_until(lambda: _pid_of(gw, "w0") == second.pid, 15)
            r = httpx.post(gw.url + "/v1/completions", timeout=30,
                           json={"prompt": "x", "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        finally:
            for proc in (first, second):
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(10)


def _start_worker(gw: GatewayServer, worker_id: str) -> subprocess.Popen:
    router, tokens = gw.config.endpoints
    return subprocess.Popen(
        zeroserve_argv("worker", "--worker-id", worker_id, "--router-address", router,
                       "--tokens-address", tokens, "--backend", "fake", "--device", "cpu",
                       "--fake-forward-ms", "5", "--heartbeat-interval", "0.1",
                       "--gateway-timeout", "1", "--log-level", "warning"),
        cwd=REPO_ROOT, env=child_env())


def _count_duplicate_refusals(gw: GatewayServer) -> list[int]:
    """The pids of the HELLOs the gateway refused as a live worker's duplicate, as they come."""
    refusals: list[int] = []
    is_duplicate = gw.gateway._is_duplicate

    def counting(peer, msg) -> bool:
        refused = is_duplicate(peer, msg)
        if refused:
            refusals.append(msg.pid)
        return refused

    gw.gateway._is_duplicate = counting
    return refusals


def _pid_of(gw: GatewayServer, worker_id: str) -> int | None:
    worker = gw.gateway.registry.get(worker_id)
    return None if worker is None else worker.hello.pid
