"""`/admin/debug/*` against a real worker process (`zeroserve worker --backend fake`): its
stacks and a profile come from that process (its own pid, its engine loop), answered over
the real wire while it serves."""

from __future__ import annotations

import os
import threading

import httpx
import pytest

from tests.gateway.helpers import GatewayServer, wait_until
from tests.gateway.test_real_worker import healthy, start_worker
from zeroserve.gateway.text.tokenizer import load_tokenizer


@pytest.mark.slow
def test_stacks_and_a_profile_of_a_serving_worker_process():
    with GatewayServer(load_tokenizer("default"), worker_timeout_s=2.0) as gw:
        proc = start_worker(gw, "real-debug")
        try:
            assert wait_until(lambda: healthy(gw), 60)
            stacks = httpx.get(gw.url + "/admin/debug/stacks", headers={"X-Zeroserve-Admin": "1"},
                               params={"worker": "real-debug"}, timeout=30).json()
            assert stacks["pid"] == proc.pid != os.getpid()
            names = {t["name"] for t in stacks["threads"]}
            assert {"MainThread", "gateway-link-0", "token-sender-0"} <= names
            main = next(t for t in stacks["threads"] if t["name"] == "MainThread")
            assert any(f["function"] == "WorkerLoop.run" for f in main["frames"])

            def load() -> None:  # a few streams busy for the profile's second
                httpx.post(gw.url + "/v1/completions", timeout=60, json={
                    "prompt": "x", "max_tokens": 400, "ignore_eos": True, "n": 4})
            client = threading.Thread(target=load)
            client.start()
            assert wait_until(lambda: len(gw.gateway.streams) > 0, 10)
            r = httpx.post(gw.url + "/admin/debug/profile", timeout=60,
                           json={"worker": "real-debug", "seconds": 1.0})
            client.join()
            assert r.status_code == 200, r.text
            engine = [line for line in r.json()["collapsed"].splitlines()
                      if line.startswith("MainThread;")]
            # The fake backend's forward (a sleep standing for device time) is sampled.
            assert any("FakeRunner." in line for line in engine), engine[:5]
        finally:
            proc.terminate()
            proc.wait(20)
