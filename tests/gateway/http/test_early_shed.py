"""The lowest class's 429 before the body is read (gateway/http/early_shed.py, issue 39): with
the queue at that class's limit and no worker with room, a flood key's request is refused at
once, with the body it would have got from admission, whatever (or however little) body it
sends; a better class's request in the same state still queues."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from tests.gateway.helpers import GatewayServer, wait_until

pytestmark = pytest.mark.timeout(60)
BULK, STANDARD = "sk-bulk", "sk-standard"
MODEL = "tiny"


def post_in_background(gw: GatewayServer, key: str) -> threading.Thread:
    """A request that holds the worker's slot or waits in the queue until the test ends."""

    def post() -> None:
        try:
            httpx.post(gw.url + "/v1/completions",
                       json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {key}"}, timeout=20)
        except httpx.HTTPError:
            pass  # the server stopped under it

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


def head_only(port: int, key: str) -> bytes:
    """A POST that sends its headers and the first byte of a 1,000-byte body, then waits for
    an answer: one only comes at once if the server answers without the body."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 1000\r\n\r\n{{".encode())
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def test_a_flood_keys_request_is_refused_before_its_body_and_a_better_class_still_queues(
        tmp_path):
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({BULK: {"priority_class": "sheddable"}}))
    # One slot, no waiting room on the worker; the sheddable class may fill 1 of the 2
    # places in the gateway's queue.
    with GatewayServer(served_model_name=MODEL, api_keys=(BULK, STANDARD),
                       rate_limits_file=str(limits), max_queued_requests=2,
                       max_waiting_per_worker=0, request_body_timeout_s=30.0) as gw:
        worker = gw.worker(max_num_seqs=1).start()
        assert worker.ready.wait(5)
        worker.is_stepping = False  # the first request holds the slot
        admission = gw.app.state.gateway.admission
        bad = httpx.post(gw.url + "/v1/completions", content=b"{",
                         headers={"Authorization": f"Bearer {BULK}",
                                  "Content-Type": "application/json"}, timeout=10)
        # The arrival ends as the 400's handler returns, just after the client has read it.
        assert bad.status_code == 400
        assert wait_until(lambda: admission.num_arriving == 0)
        post_in_background(gw, BULK)
        assert wait_until(lambda: len(worker.submits) == 1)
        post_in_background(gw, BULK)
        assert wait_until(lambda: admission.num_queued == 1)

        answer = head_only(gw.port, BULK)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 429"), answer[:200]
        assert b"retry-after: 1" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == "queue_full" and "'sheddable'" in error["message"]
        assert admission.stats.by_class[2].num_shed == 1
        # Messages: the same refusal, in Anthropic's error shape.
        r = httpx.post(gw.url + "/v1/messages",
                       json={"model": MODEL, "max_tokens": 2,
                             "messages": [{"role": "user", "content": "hi"}]},
                       headers={"Authorization": f"Bearer {BULK}"}, timeout=10)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "rate_limit_error"
        assert admission.stats.by_class[2].num_shed == 2

        # A standard key's request in the same state is not refused: it queues.
        post_in_background(gw, STANDARD)
        assert wait_until(lambda: admission.num_queued == 2)
        metrics = httpx.get(gw.url + "/metrics", headers={"Authorization": f"Bearer {BULK}"},
                            timeout=10).text
        assert 'reason="queue_full"} 2.0' in metrics
        assert wait_until(lambda: admission.num_arriving == 0)  # at a worker, queued, refused
        worker.stop()
