"""The gateway's listening sockets (gateway/server.py, BatchAcceptor): a burst of clients is
accepted in a few passes of a busy event loop, not one client per pass, and a stopped
server takes no more connections."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.gateway.helpers import GatewayServer, wait_until

NUM_CLIENTS = 200
PASS_S = 0.003  # the CPU each pass of the loop spends on other work (relaying, admitting)


def on_uvloop(server: GatewayServer) -> GatewayServer:
    """The server on uvloop, as `zeroserve gateway` runs it (uvicorn's loop="auto"); uvloop
    (libuv) accepts one connection per pass of the loop."""
    uvloop = pytest.importorskip("uvloop")
    server._thread = threading.Thread(target=lambda: uvloop.run(server._serve()),
                                      daemon=True)
    return server


def test_a_burst_of_clients_is_accepted_in_a_few_passes_of_a_busy_loop():
    with on_uvloop(GatewayServer()) as server:
        loop = server.loop
        connections = server.server.server_state.connections
        passes = [0]
        all_in_at: list[int] = []  # the pass that saw every client's connection
        is_busy = [True]

        def busy() -> None:  # every pass of the loop does PASS_S of other work
            passes[0] += 1
            if not all_in_at and len(connections) >= NUM_CLIENTS:
                all_in_at.append(passes[0])
            end = time.perf_counter() + PASS_S
            while time.perf_counter() < end:
                pass
            if is_busy[0]:
                loop.call_soon(busy)

        loop.call_soon_threadsafe(busy)
        assert wait_until(lambda: passes[0] > 2, 10)
        clients = []
        try:
            clients = [socket.create_connection(("127.0.0.1", server.port), timeout=30)
                       for _ in range(NUM_CLIENTS)]
            connected_at = passes[0]  # (read late on a loaded machine: fewer passes left)
            assert wait_until(lambda: all_in_at, 60)
            # One accept per pass took NUM_CLIENTS passes, less those during the connects.
            assert all_in_at[0] - connected_at <= 10
        finally:
            is_busy[0] = False
            for client in clients:
                client.close()


def test_a_stopped_server_refuses_new_connections():
    server = GatewayServer()
    with server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10):
            pass
    assert not server._thread.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=10)
