"""A streamed response's head goes out in the same write as its first event
(gateway/http/held_head.py), with the same bytes; alone when the first event is slow."""

from __future__ import annotations

import json
import select
import socket

import pytest

from tests.gateway.helpers import GatewayServer, cyclic_reply, wait_until
from zeroserve.gateway.http import held_head

ORIGIN = "https://app.example"


@pytest.fixture
def served():
    with GatewayServer(allowed_origins=(ORIGIN,)) as gw:
        worker = gw.worker(reply=cyclic_reply("ab")).start()
        assert worker.ready.wait(5)
        yield gw, worker
        worker.stop()


def open_stream(gw, max_tokens: int = 2) -> socket.socket:
    data = json.dumps({"prompt": "x", "max_tokens": max_tokens, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", gw.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                 b"Origin: " + ORIGIN.encode() + b"\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def read_all(sock: socket.socket, first: bytes) -> bytes:
    sock.settimeout(10)
    out = first
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_the_head_and_the_first_event_come_in_one_write(served, monkeypatch):
    gw, worker = served
    monkeypatch.setattr(held_head, "HEAD_HOLD_S", 60.0)
    worker.is_stepping = False  # the first token waits until the test lets it go
    with open_stream(gw) as sock:
        assert wait_until(lambda: worker.submits, 5)
        # Admitted, no token yet: nothing is on the wire (the head waits for the event).
        assert select.select([sock], [], [], 0.5)[0] == []
        worker.is_stepping = True
        sock.settimeout(10)
        first = sock.recv(65536)
        head, _, rest = first.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert rest.split(b"\r\n", 1)[1].startswith(b"data: ")  # its first event's chunk
        whole = read_all(sock, first)
    lower = head.lower()
    # The head is uvicorn's, through every middleware: CORS's header is in it.
    assert b"content-type: text/event-stream; charset=utf-8" in lower
    assert b"transfer-encoding: chunked" in lower
    assert b"access-control-allow-origin: " + ORIGIN.encode() in lower
    assert whole.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert whole.count(b"HTTP/1.1") == 1


def test_a_head_waits_no_longer_than_its_hold(served, monkeypatch):
    gw, worker = served
    monkeypatch.setattr(held_head, "HEAD_HOLD_S", 0.05)
    worker.is_stepping = False  # no token comes until the head has arrived alone
    with open_stream(gw) as sock:
        sock.settimeout(10)
        first = sock.recv(65536)
        while b"\r\n\r\n" not in first:
            first += sock.recv(65536)
        head, _, rest = first.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and rest == b""
        worker.is_stepping = True
        whole = read_all(sock, first)
    assert b'"text":"a"' in whole and whole.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


def test_a_client_gone_while_its_head_is_held_frees_its_request(served, monkeypatch):
    gw, worker = served
    monkeypatch.setattr(held_head, "HEAD_HOLD_S", 60.0)
    worker.is_stepping = False
    sock = open_stream(gw, max_tokens=50)
    assert wait_until(lambda: worker.submits, 5)
    sock.close()
    assert wait_until(lambda: worker.aborts, 5)
    assert wait_until(lambda: len(gw.gateway.streams) == 0, 5)
    worker.is_stepping = True
