"""Two live processes with one worker id (a copied key, a misconfiguration): the gateway
keeps the first and refuses the second until the first is gone, on real sockets."""

from __future__ import annotations

import threading

import httpx

from tests.gateway.helpers import GatewayServer, cyclic_reply, wait_until


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
