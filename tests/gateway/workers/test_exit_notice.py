"""A worker process that its supervisor saw exit is taken out at once (issue 37): `serve`'s
supervisor tells the gateway (cli/children.py's GatewayExitNotice -> POST
/admin/workers/{id}/exited), and the worker's streams move to a live worker without waiting
for its heartbeats to lapse; a notice about an older process never removes its successor;
and a busy machine, which cannot fake an exit, never loses a live worker."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.gateway.helpers import GatewayServer, cyclic_reply, wait_until
from zeroserve.cli.children import GatewayExitNotice

# Far longer than the tests' waits: only the exit notice can make the gateway move on.
SILENCE_TIMEOUT_S = 120.0
WAIT_S = 30.0
PROMPT = "a prompt of a few blocks " * 4


def events(metrics: str, worker_id: str) -> dict[str, float]:
    found = re.findall(r'^zeroserve:worker_events_total\{([^}]*)\} (\S+)$', metrics, re.MULTILINE)
    return {re.search(r'event="(\w+)"', labels).group(1): float(value)
            for labels, value in found if f'worker_id="{worker_id}"' in labels}


def post_in_thread(url: str, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(r=httpx.post(
        url + "/v1/completions", timeout=WAIT_S + 10, json=body)), daemon=True)
    thread.start()
    return thread, result


def test_a_stream_moves_at_once_when_its_workers_exit_is_told():
    with GatewayServer(worker_timeout_s=SILENCE_TIMEOUT_S) as gw:
        workers = [gw.worker(worker_id=f"w{i}", reply=cyclic_reply("ab"), step_s=0.01).start()
                   for i in range(2)]
        assert all(w.ready.wait(5) for w in workers)
        client, result = post_in_thread(gw.url, {"prompt": PROMPT, "max_tokens": 200})
        assert wait_until(lambda: any(w.num_sent.get(s.request_id, 0) >= 5
                                      for w in workers for s in w.submits), WAIT_S)
        victim = next(w for w in workers if w.submits)
        survivor = next(w for w in workers if w is not victim)
        victim.stop()  # its sockets close, as a SIGKILLed process's do; the gateway waits
        # `serve`'s supervisor reaped it: it says so, with the pid and how it ended.
        assert GatewayExitNotice(gw.url)(victim.worker_id, victim.pid, -9) == {
            httpx.get(gw.url + "/health/live").json()["pid"]}
        client.join(WAIT_S)
        assert not client.is_alive(), "the stream waited on the dead worker"
        assert result["r"].status_code == 200, result["r"].text
        assert result["r"].json()["choices"][0]["text"] == "ab" * 100  # nothing lost or twice
        assert len(survivor.submits) == 1  # it went on there
        assert gw.gateway.registry.get(victim.worker_id) is None
        lost = httpx.get(gw.url + "/health").json()["lost_workers"]
        assert [(w["worker_id"], w["pid"], w["reason"]) for w in lost] == [
            (victim.worker_id, victim.pid, "exited (killed by SIGKILL)")]
        assert events(httpx.get(gw.url + "/metrics").text, victim.worker_id) == {"exited": 1.0}
        # New requests go to the live worker.
        r = httpx.post(gw.url + "/v1/completions", timeout=WAIT_S,
                       json={"prompt": PROMPT, "max_tokens": 4})
        assert r.json()["choices"][0]["text"] == "abab"
        assert len(survivor.submits) == 2
        survivor.stop()


def test_a_late_notice_about_an_older_process_spares_its_successor():
    with GatewayServer(worker_timeout_s=SILENCE_TIMEOUT_S) as gw:
        old = gw.worker(worker_id="w0", reply=cyclic_reply("ab")).start()
        assert old.ready.wait(5)
        old.stop()
        new = gw.worker(worker_id="w0", reply=cyclic_reply("ab"), step_s=0.01).start()
        assert new.ready.wait(5)  # its HELLO replaced the old process
        assert gw.gateway.registry.get("w0").hello.pid == new.pid
        client, result = post_in_thread(gw.url, {"prompt": PROMPT, "max_tokens": 100})
        assert wait_until(lambda: any(new.num_sent.get(s.request_id, 0) >= 5
                                      for s in new.submits), WAIT_S)
        r = httpx.post(gw.url + "/admin/workers/w0/exited", timeout=WAIT_S,
                       json={"pid": old.pid, "exit_code": -9})
        assert r.status_code == 200 and r.json()["removed"] is False
        client.join(WAIT_S)
        assert result["r"].json()["choices"][0]["text"] == "ab" * 50
        assert len(new.submits) == 1  # never moved
        assert gw.gateway.registry.get("w0").hello.pid == new.pid
        assert "exited" not in events(httpx.get(gw.url + "/metrics").text, "w0")
        # An id nobody holds: nothing to do, said as much.
        r = httpx.post(gw.url + "/admin/workers/nobody/exited", json={"pid": 7})
        assert r.status_code == 200 and r.json()["removed"] is False
        new.stop()


@pytest.mark.parametrize("body, param", [
    ({}, "pid"), ({"pid": "12"}, "pid"), ({"pid": True}, "pid"), ({"pid": 0}, "pid"),
    ({"pid": 2**40}, "pid"), ({"pid": 12, "exit_code": 1.5}, "exit_code"),
    ({"pid": 12, "exit_code": 999}, "exit_code"),
])
def test_a_malformed_notice_is_a_400_that_removes_nothing(body, param):
    with GatewayServer(worker_timeout_s=SILENCE_TIMEOUT_S) as gw:
        worker = gw.worker(worker_id="w0").start()
        assert worker.ready.wait(5)
        r = httpx.post(gw.url + "/admin/workers/w0/exited", json=body)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == param
        assert gw.gateway.registry.get("w0") is not None
        worker.stop()


def test_only_an_admin_may_say_a_worker_exited():
    with GatewayServer(worker_timeout_s=SILENCE_TIMEOUT_S, admin_keys=("sk-admin",)) as gw:
        worker = gw.worker(worker_id="w0").start()
        assert worker.ready.wait(5)
        assert GatewayExitNotice(gw.url)("w0", worker.pid, -9) == set()  # no key: refused
        r = httpx.post(gw.url + "/admin/workers/w0/exited", json={"pid": worker.pid})
        assert r.status_code == 401
        assert gw.gateway.registry.get("w0") is not None
        assert GatewayExitNotice(gw.url, "sk-admin")("w0", worker.pid, 0)  # serve's key
        assert gw.gateway.registry.get("w0") is None
        assert gw.gateway.registry.lost["w0"].reason == "exited (exit code 0)"
        worker.stop()


@pytest.mark.slow
def test_a_busy_machine_never_loses_a_serving_worker():
    """The reverted connection probe (d0b9f9e) declared live workers 'exited (its connection
    closed)' with three busy loops beside the suite. Nothing here guesses a death: busy
    loops on every core beside a fake worker that serves for a few seconds, at the product's
    heartbeat settings, and the worker is never lost, its streams never moved."""
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(3)]
    try:
        with GatewayServer(heartbeat_interval_s=0.5, worker_timeout_s=3.0) as gw:
            worker = gw.worker(worker_id="w0", reply=cyclic_reply("ab"), step_s=0.005).start()
            assert worker.ready.wait(WAIT_S)
            handle = gw.gateway.registry.get("w0")
            deadline = time.monotonic() + 4.0
            num_done = 0
            while time.monotonic() < deadline or num_done < 4:
                threads = [post_in_thread(gw.url, {"prompt": f"{PROMPT} {i}", "max_tokens": 40})
                           for i in range(4)]
                for thread, result in threads:
                    thread.join(WAIT_S)
                    assert result["r"].status_code == 200, result["r"].text
                    assert result["r"].json()["choices"][0]["text"] == "ab" * 20
                    num_done += 1
                assert gw.gateway.registry.get("w0") is handle, "the live worker was lost"
            assert len(worker.submits) == num_done  # each stream once: none moved
            assert events(httpx.get(gw.url + "/metrics").text, "w0") == {}
            assert not gw.gateway.registry.lost
            worker.stop()
    finally:
        for process in busy:
            process.kill()
            process.wait()
