"""Hostile input against a live server (real processes, the fake backend): each gets its
4xx while a probe stream runs, the probe finishes intact, and afterwards nothing is in flight
and every KV block is free.

One server for the module; the hostile inputs go one after another beside one probe.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import pytest

from tests.e2e.helpers import MODEL, is_idle, stream_in_thread

pytestmark = pytest.mark.slow

HEADER_TIMEOUT_S = 1.0
PROBE_TOKENS = 3000  # ~16 s at 5 ms a step (held open half-way until the inputs are sent)
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(module_servers):
    return module_servers(args=(
        "--backend", "fake", "--device", "cpu", "--fake-forward-ms", "5",
        "--num-kv-blocks", "1024", "--header-timeout", str(HEADER_TIMEOUT_S),
        "--request-body-timeout", "2",
    ))


def raw_request(port: int, head: bytes, body_chunks=(), wait_s: float = 5.0) -> bytes:
    """Send a head, then body chunks until the server answers; return what it sent."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head)
        for chunk in body_chunks:
            if select.select([sock], [], [], 0)[0]:
                break  # it answered already
            try:
                sock.sendall(chunk)
            except OSError:
                break
        sock.settimeout(wait_s)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def status_of(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    return status, json.loads(body)["error"] if body.startswith(b"{") else {}


def post(server, path: str, raw: bytes, headers=None) -> httpx.Response:
    return httpx.post(server.url + path, content=raw, headers=headers or JSON, timeout=30)


def check_error(r: httpx.Response, status: int, param: str | None = None) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param


def send_hostile_inputs(server) -> None:
    port = server.port
    # 30 MB declared (the first MiB sent): refused on the Content-Length, before the body.
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\n"
            b"content-type: application/json\r\ncontent-length: 31457280\r\n\r\n")
    status, error = status_of(raw_request(port, head, [b" " * 65536] * 16))
    assert status == 413 and error["code"] == "request_too_large"
    # 30 MB chunked, no length: refused once 8 MiB have arrived.
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\n"
            b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
    chunk = b"10000\r\n" + b" " * 65536 + b"\r\n"
    status, error = status_of(raw_request(port, head, [chunk] * 480))
    assert status == 413 and error["code"] == "request_too_large"

    check_error(post(server, "/v1/completions", b'{"prompt": ' + b"[" * 100_000
                     + b"]" * 100_000 + b"}"), 400)
    check_error(post(server, "/v1/completions", b'{"model": "' + MODEL.encode()
                     + b'", "prompt": "x", "temperature": 1' + b"0" * 400 + b"}"), 400)
    for field in (b"top_k", b"seed", b"n", b"max_tokens"):
        check_error(post(server, "/v1/completions", b'{"prompt": "x", "' + field + b'": '
                         + str(2 ** 64).encode() + b"}"), 400, field.decode())
    check_error(post(server, "/v1/completions",
                     b'{"prompt": "x", "stop_token_ids": [18446744073709551616]}'), 400,
                "stop_token_ids")
    check_error(post(server, "/v1/completions", json.dumps(
        {"prompt": "x", "stop_token_ids": [1] * 2_000_000}).encode()), 400, "stop_token_ids")
    check_error(post(server, "/v1/completions", b'{"prompt": "a\\ud800b"}'), 400)
    check_error(post(server, "/v1/chat/completions",
                     b'{"messages": [{"role": "user", "content": "\\udfff"}]}'), 400)
    check_error(post(server, "/v1/completions", b'{"model": "\\ud83d", "prompt": "x"}'), 400)
    check_error(post(server, "/tokenize", b'{"prompt": "\\ud800"}'), 400)
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        check_error(post(server, path, b'{"prompt": "x"}', {"content-type": "text/plain"}),
                    415)

    # Slow headers: the connection is closed at the header timeout, unanswered.
    started = time.monotonic()
    out = raw_request(port, b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\n", wait_s=10)
    # Closed by the server (well before our 10 s wait, and the default header timeout, ran
    # out): a generous deadline on a loaded machine.
    assert out == b"" and time.monotonic() - started < HEADER_TIMEOUT_S + 7
    # A slow body: 408.
    status, error = status_of(raw_request(
        port, b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json"
              b"\r\ncontent-length: 100\r\n\r\n{", wait_s=10))
    assert status == 408 and error["code"] == "request_body_timeout"


def test_hostile_inputs_get_4xx_and_end_no_one_elses_stream(server):
    server.wait_for(is_idle, timeout_s=10, what="idle before the test")
    all_sent = threading.Event()

    def hold_open(num_chunks: int) -> None:
        """Half-way, the probe stops reading until every hostile input was sent (paused by
        its credit meanwhile), so it spans them all however slow a loaded machine is."""
        if num_chunks == PROBE_TOKENS // 2:
            all_sent.wait(60)

    thread, probe = stream_in_thread(server.url, {
        "prompt": "Probe.", "max_tokens": PROBE_TOKENS, "ignore_eos": True,
        "stream_options": {"include_usage": True}}, timeout_s=120, on_chunk=hold_open)
    try:
        deadline = time.monotonic() + 10
        while not probe.chunks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert probe.chunks, "the probe stream did not start"

        send_hostile_inputs(server)
        assert thread.is_alive(), ("the probe ended before the hostile inputs were all sent",
                                   probe.elapsed_s, probe.error, probe.exception,
                                   len(probe.chunks))
    finally:
        all_sent.set()

    thread.join(60)
    assert probe.exception is None and probe.error is None, (probe.exception, probe.error)
    assert probe.is_done and probe.finish_reason == "length"
    assert probe.usage["completion_tokens"] == PROBE_TOKENS
    server.wait_for(is_idle, timeout_s=10, what="every KV block free afterwards")
    _, health = server.health()
    assert health["num_requests"] == 0
    assert all(w["num_free_blocks"] == w["num_total_blocks"] for w in health["workers"])
    log = server.log_tail(100_000)
    assert "Traceback" not in log and "unhandled error" not in log, log[-3000:]
