"""The gateway's HTTP server stopping with requests open: each gets a clear 503, none a
plain-text 500 or a stream cut with no word."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.gateway.helpers import GatewayServer, cyclic_reply, wait_until

pytestmark = pytest.mark.slow


def test_a_stopping_server_ends_waiting_and_running_requests_with_a_503():
    # One slot on the one worker and no room for more: the second request waits in the
    # gateway's queue. The server's grace is 1 s, so running streams end at 0.5 s.
    with GatewayServer(max_waiting_per_worker=0,
                       uvicorn_overrides={"timeout_graceful_shutdown": 1}) as gw:
        worker = gw.worker(reply=cyclic_reply("x" * 50), step_s=0.02, max_num_seqs=1).start()
        assert worker.ready.wait(5)
        events: list[str] = []
        waiting: dict = {}

        def stream() -> None:
            body = {"prompt": "a", "max_tokens": 2000, "stream": True}
            with httpx.stream("POST", f"{gw.url}/v1/completions", json=body,
                              timeout=30) as response:
                events.extend(line[6:] for line in response.iter_lines()
                              if line.startswith("data: "))

        def wait_for_worker() -> None:
            response = httpx.post(f"{gw.url}/v1/completions",
                                  json={"prompt": "b", "max_tokens": 5}, timeout=30)
            waiting.update(status=response.status_code, body=response.json())

        threads = [threading.Thread(target=stream), threading.Thread(target=wait_for_worker)]
        threads[0].start()
        assert wait_until(lambda: len(events) >= 3, 5)
        threads[1].start()
        assert wait_until(lambda: gw.gateway.admission.num_queued == 1, 5)

        gw.server.should_exit = True
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
        assert waiting["status"] == 503 and waiting["body"]["error"]["code"] == "shutdown"
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "shutdown"
        assert len(events) > 5  # it streamed until the server stopped
        assert wait_until(lambda: worker.aborts, 5)  # and its work was ended on the worker
