"""The worker plane on tcp:// with CurveZMQ keys, against hostile peers on real sockets: none
is listed or accepted, and a stream in flight finishes intact."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import zmq

from tests.gateway.helpers import GatewayServer, cyclic_reply, free_port, wait_until
from zeroserve.common.keys import WorkerKeys, generate, load_worker_keys
from zeroserve.common.protocol import (
    PROTOCOL_VERSION,
    Heartbeat,
    Hello,
    TokenOutput,
    Tokens,
    encode,
)


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("keys"), ["worker-0", "worker-1"])


@pytest.fixture
def plane(key_dir):
    """A gateway on tcp:// with keys and one keyed worker streaming slowly."""
    router, tokens = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with GatewayServer(router_address=router, tokens_address=tokens,
                       keys_dir=str(key_dir)) as gw:
        worker = gw.worker(worker_id="worker-0", keys=load_worker_keys(key_dir, "worker-0"),
                           reply=cyclic_reply("abcd"), step_s=0.01).start()
        assert worker.ready.wait(5)
        yield gw, worker, key_dir
        worker.stop()


class Probe:
    """A streamed completion read on a thread: the stream that must come through intact."""

    def __init__(self, gw, max_tokens: int = 150):
        self.text, self.error, self.finish = [], None, None
        self.thread = threading.Thread(target=self._run, args=(gw, max_tokens), daemon=True)
        self.thread.start()

    def _run(self, gw, max_tokens: int) -> None:
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=30, json={
                "prompt": "x", "max_tokens": max_tokens, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = event["error"]
                    else:
                        self.text.append(event["choices"][0]["text"])
                        self.finish = event["choices"][0]["finish_reason"] or self.finish

    def assert_intact(self, max_tokens: int = 150) -> None:
        self.thread.join(30)
        assert self.error is None and self.finish == "length"
        assert "".join(self.text) == ("abcd" * max_tokens)[:max_tokens]


def listed(gw) -> set[str]:
    return {w["worker_id"] for w in httpx.get(gw.url + "/health").json()["workers"]}


def dealer(ctx, address: str, route: bytes, keys=None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, route)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        from zeroserve.common.keys import curve_client

        curve_client(sock, keys)
    sock.connect(address)
    return sock


def hello(worker_id: str) -> Hello:
    return Hello(PROTOCOL_VERSION, worker_id, "rogue", 4096, 1000, 16, 64, "cpu", 1)


def test_peers_without_a_listed_key_never_get_in(plane, tmp_path):
    gw, worker, key_dir = plane
    probe = Probe(gw)
    # A pair of its own that knows the gateway's public key, but is on no allow-list.
    other = load_worker_keys(generate(tmp_path / "other", ["worker-9"]), "worker-9")
    stranger_keys = WorkerKeys(other.own, load_worker_keys(key_dir, "worker-0").gateway_public)
    ctx = zmq.Context()
    try:
        # No keys at all: the CURVE handshake never completes. An unknown key: ZAP says no.
        for keys in (None, stranger_keys):
            sock = dealer(ctx, gw.config.router_address, b"rogue.1", keys)
            try:
                sock.send_multipart(encode(hello("rogue")), zmq.NOBLOCK)
            except zmq.Again:
                pass  # not even queued: no connection would take it (its handshake failed)
        zap = gw.gateway.edge._zap
        assert wait_until(lambda: zap.num_denied >= 1, 3)
        time.sleep(0.5)
        assert listed(gw) == {"worker-0"}
    finally:
        ctx.destroy(linger=0)
    probe.assert_intact()


def test_a_keyed_worker_cannot_speak_as_another(plane):
    gw, worker, key_dir = plane
    probe = Probe(gw)
    assert wait_until(lambda: worker.submits, 5)
    victim_request = worker.submits[0].request_id
    keys_1 = load_worker_keys(key_dir, "worker-1")
    ctx = zmq.Context()
    try:
        # Worker-1's key says HELLO as worker-0: refused, and worker-0 keeps its place.
        impostor = dealer(ctx, gw.config.router_address, b"worker-0.forged", keys_1)
        impostor.send_multipart(encode(hello("worker-0")))
        assert impostor.poll(3000)
        _, body = impostor.recv_multipart()
        assert b"issued for" in body
        # Its PUSH writes tokens into worker-0's stream: dropped (its key is not worker-0's).
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        from zeroserve.common.keys import curve_client

        curve_client(push, keys_1)
        push.connect(gw.config.tokens_address)
        for step in range(50):
            push.send_multipart(encode(Tokens("worker-0", step, [
                TokenOutput(victim_request, [ord("X")], None, 1, 1000 + step)])))
        # And heartbeats claiming to be worker-0 from its own route change nothing.
        impostor.send_multipart(encode(Heartbeat("worker-0", "draining")))
        time.sleep(0.5)
        assert listed(gw) == {"worker-0"}
        assert gw.gateway.registry.get("worker-0").status.value == "ready"
    finally:
        ctx.destroy(linger=0)
    probe.assert_intact()
    assert worker.submits[0].request_id == victim_request and len(worker.submits) == 1


def test_oversized_and_malformed_frames_are_dropped(plane):
    gw, worker, key_dir = plane
    probe = Probe(gw)
    keys_1 = load_worker_keys(key_dir, "worker-1")
    ctx = zmq.Context()
    try:
        sock = dealer(ctx, gw.config.router_address, b"worker-1.flood", keys_1)
        sock.send(b"\x00" * (64 * 2**20))  # past the message size limit: cut off
        flood = dealer(ctx, gw.config.router_address, b"worker-1.junk", keys_1)
        for i in range(2000):
            flood.send_multipart([bytes([i % 256]), b"\xc1" * (i % 50)])
        assert wait_until(lambda: gw.gateway.edge.num_dropped >= 1000, 10)
    finally:
        ctx.destroy(linger=0)
    probe.assert_intact()
    assert listed(gw) == {"worker-0"}
