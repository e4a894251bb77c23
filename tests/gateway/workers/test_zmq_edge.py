"""The gateway's ZeroMQ edge on real sockets: what libzmq does to connections, below our
own messages (gateway/workers/zmq_io.py, common/socket_liveness.py)."""

from __future__ import annotations

import asyncio
import time

import httpx
import zmq

from tests.gateway.helpers import GatewayServer, cyclic_reply, free_port
from zeroserve.common.protocol import Heartbeat, decode, encode
from zeroserve.gateway.workers.zmq_io import ZmqEdge

ROUTE = b"worker-0.0123456789abcdef01234567"


def dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, ROUTE)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


async def heard(got: list, what: str, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(msg.worker_id == what for _, msg in got):
            return True
        await asyncio.sleep(0.02)
    return False


def test_a_worker_reconnecting_with_its_route_is_heard_again():
    """After a partition the gateway may still hold the worker's old (half-open) connection
    under its route; the worker's new connection with the same route must take it over,
    both ways (ROUTER_HANDOVER), not be ignored for as long as the old one lingers."""

    async def scenario() -> tuple[bool, bool, bool]:
        got: list = []
        router = f"tcp://127.0.0.1:{free_port()}"
        edge = ZmqEdge(router, f"tcp://127.0.0.1:{free_port()}",
                       lambda peer, msg: got.append((peer.route, msg)))
        edge.start()
        ctx = zmq.Context()
        try:
            old = dealer(ctx, router)  # the connection a partition left open on our side
            old.send_multipart(encode(Heartbeat(worker_id="old")))
            heard_old = await heard(got, "old")
            new = dealer(ctx, router)  # the same process, reconnected
            new.send_multipart(encode(Heartbeat(worker_id="new")))
            heard_new = await heard(got, "new")
            edge.send_route(ROUTE, Heartbeat(worker_id="to-worker"))
            deadline = time.monotonic() + 5  # polled: a loaded machine may take a while
            while not new.poll(0) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            answered = bool(new.poll(0)) and decode(new.recv_multipart()).worker_id == \
                "to-worker"
            return heard_old, heard_new, answered
        finally:
            ctx.destroy(linger=0)
            await edge.close()

    heard_old, heard_new, answered = asyncio.run(scenario())
    assert heard_old
    assert heard_new, "the reconnected worker's messages were dropped"
    assert answered, "the gateway's messages to that route went to the dead connection"


def test_the_gateway_sockets_have_zmtp_heartbeats_and_tcp_keepalive():
    """A dead peer's connection is closed by libzmq (and a half-open one by the kernel), so
    a reconnect never waits behind a ghost. (The worker's sockets get the same options from
    common/socket_liveness.py.)"""

    async def scenario() -> list[tuple[int, int, int, int]]:
        edge = ZmqEdge(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}",
                       lambda peer, msg: None)
        edge.start()
        try:
            return [(s.getsockopt(zmq.HEARTBEAT_IVL), s.getsockopt(zmq.HEARTBEAT_TIMEOUT),
                     s.getsockopt(zmq.HEARTBEAT_TTL), s.getsockopt(zmq.TCP_KEEPALIVE))
                    for s in (edge._router, edge._pull)]
        finally:
            await edge.close()

    for ivl, timeout, ttl, keepalive in asyncio.run(scenario()):
        assert 0 < ivl < timeout and ttl > 0 and keepalive == 1


def test_a_failure_in_the_receive_loop_restarts_it_and_is_counted():
    """Something unexpected escaping the receive loop (not a handler: those are caught per
    message) must not leave a gateway that answers liveness but never hears a worker
    again: the loop is restarted, logged and counted on /metrics."""
    with GatewayServer() as gw:
        worker = gw.worker(worker_id="w0", reply=cyclic_reply("ab")).start()
        assert worker.ready.wait(5)
        edge = gw.gateway.edge
        drain_tokens = edge._drain_tokens
        num_calls = [0]

        async def fails_once() -> None:
            num_calls[0] += 1
            if num_calls[0] == 1:
                raise RuntimeError("an unexpected fault in the receive loop")
            await drain_tokens()

        edge._drain_tokens = fails_once
        r = httpx.post(gw.url + "/v1/completions", timeout=10,
                       json={"prompt": "x", "max_tokens": 6})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ababab"
        assert edge.num_receive_restarts == 1
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'zeroserve:zmq_receive_loop_restarts_total{model_name=' in metrics
        assert httpx.get(gw.url + "/health/live").status_code == 200
        worker.stop()


def test_without_its_zap_handler_a_curve_socket_fails_closed(tmp_path):
    """The ZAP handler vets every CURVE peer; should it be gone (its thread died), a peer
    with a key that is on no allow-list must still not get a message through."""
    from zeroserve.common.keys import generate, load_gateway_keys

    key_dir = generate(tmp_path / "keys", ["worker-0"])

    async def scenario() -> list:
        got: list = []
        router = f"tcp://127.0.0.1:{free_port()}"
        edge = ZmqEdge(router, f"tcp://127.0.0.1:{free_port()}",
                       lambda peer, msg: got.append(msg), keys=load_gateway_keys(key_dir))
        edge._dispatch_router = got.append  # every message the ROUTER lets through
        edge.start()
        edge._zap.stop()  # the handler is gone
        ctx = zmq.Context()
        try:
            stranger = ctx.socket(zmq.DEALER)
            stranger.setsockopt(zmq.LINGER, 0)
            public, secret = zmq.curve_keypair()
            stranger.curve_serverkey = edge.keys.own.public
            stranger.curve_publickey, stranger.curve_secretkey = public, secret
            stranger.connect(router)
            stranger.send_multipart(encode(Heartbeat(worker_id="stranger")))
            await asyncio.sleep(1.0)
            return got
        finally:
            ctx.destroy(linger=0)
            await edge.close()

    assert asyncio.run(scenario()) == []
