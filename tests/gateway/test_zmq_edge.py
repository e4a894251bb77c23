"""The gateway's ZeroMQ edge on real sockets: what libzmq does to connections, below our
own messages (gateway/workers/zmq_io.py, common/socket_liveness.py)."""

from __future__ import annotations

import asyncio
import time

import zmq

from tests.gateway.helpers import free_port
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
            await asyncio.sleep(0.2)
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
