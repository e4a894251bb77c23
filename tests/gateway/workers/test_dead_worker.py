"""A worker process that dies (its connection closes) is taken out of routing at once: its
streams fail over to a live worker, and new requests go there, without waiting for its
heartbeats to lapse or for its restarted process to say HELLO (issue 37: a killed worker's
stream waited ~2.6 s for that worker's restart)."""

from __future__ import annotations

import re
import threading

import httpx

from tests.gateway.helpers import GatewayServer, cyclic_reply, wait_until
from zeroserve.common.protocol import PROTOCOL_VERSION, Hello
from zeroserve.gateway.workers.registry import WorkerRegistry

# Far longer than the test's waits: only a dead connection can make the gateway move on.
SILENCE_TIMEOUT_S = 120.0
WAIT_S = 30.0


def test_a_dead_workers_stream_moves_to_the_live_one_before_its_timeout():
    with GatewayServer(worker_timeout_s=SILENCE_TIMEOUT_S) as gw:
        workers = [gw.worker(worker_id=f"w{i}", reply=cyclic_reply("ab"), step_s=0.01).start()
                   for i in range(2)]
        assert all(w.ready.wait(5) for w in workers)
        result: dict = {}
        client = threading.Thread(target=lambda: result.update(r=httpx.post(
            gw.url + "/v1/completions", timeout=WAIT_S + 10,
            json={"prompt": "a prompt of a few blocks " * 4, "max_tokens": 200})))
        client.start()
        assert wait_until(lambda: any(w.num_sent.get(s.request_id, 0) >= 5
                                      for w in workers for s in w.submits), WAIT_S)
        victim = next(w for w in workers if w.submits)
        survivor = next(w for w in workers if w is not victim)
        victim.stop()  # the process is gone: its sockets close, as a SIGKILL's do
        client.join(WAIT_S)
        assert not client.is_alive(), "the stream waited on the dead worker"
        assert result["r"].status_code == 200, result["r"].text
        assert result["r"].json()["choices"][0]["text"] == "ab" * 100
        assert len(survivor.submits) == 1  # it went on there
        assert gw.gateway.registry.get(victim.worker_id) is None
        assert victim.worker_id in gw.gateway.registry.lost
        # A new request goes to the live worker too.
        r = httpx.post(gw.url + "/v1/completions", timeout=WAIT_S,
                       json={"prompt": "a prompt of a few blocks " * 4, "max_tokens": 4})
        assert r.json()["choices"][0]["text"] == "abab"
        assert len(survivor.submits) == 2
        # Its restart (a new process of its id) is counted once as such, after its exit.
        back = gw.worker(worker_id=victim.worker_id, reply=cyclic_reply("ab")).start()
        assert back.ready.wait(5)
        metrics = httpx.get(gw.url + "/metrics").text
        assert events(metrics, victim.worker_id) == {"exited": 1.0, "restarted": 1.0}
        back.stop()
        survivor.stop()


def events(metrics: str, worker_id: str) -> dict[str, float]:
    found = re.findall(r'^zeroserve:worker_events_total\{([^}]*)\} (\S+)$', metrics, re.MULTILINE)
    return {re.search(r'event="(\w+)"', labels).group(1): float(value)
            for labels, value in found if f'worker_id="{worker_id}"' in labels}


def test_one_missed_beat_stops_routing_and_the_second_loses_the_worker():
    reg = WorkerRegistry()
    for i in range(2):
        reg.register(Hello(PROTOCOL_VERSION, f"w{i}", "m", 4096, 100, 16, 8, "cpu", i + 1),
                     f"w{i}.r".encode(), 0.0)
    assert reg.on_reachable("w0", False, 1.0) is None  # once: maybe a reconnect
    assert not reg.get("w0").can_accept and not reg.get("w0").can_accept_priority
    assert reg.pick().worker_id == "w1"
    assert reg.on_reachable("w0", True, 1.5) is None  # it was: routed to again
    assert reg.get("w0").can_accept
    assert reg.on_reachable("w0", False, 2.0) is None
    lost = reg.on_reachable("w0", False, 2.5)  # twice in a row: gone
    assert lost is not None and lost.worker_id == "w0"
    assert reg.get("w0") is None and reg.lost["w0"].pid == 1
