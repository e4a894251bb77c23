"""TOKENS still queued from a dead process of a worker id must not move the TOKENS sequence
of the process that replaced it (issue 35, item 3): the gateway compares a heartbeat's
`tokens_seq` with the last one it processed to tell outputs still on their way from lost
ones (gateway/reconcile.py), and a stale high value would turn that off. The PULL socket has
no routes: a worker names its process in its connection's metadata (worker/link.py)."""

from __future__ import annotations

import zmq

from tests.gateway.helpers import GatewayServer, wait_until
from zeroserve.common.protocol import Tokens, encode


def push_as(ctx: zmq.Context, address: str, incarnation: str | None) -> zmq.Socket:
    """A PUSH to the gateway's PULL, as the process `incarnation` (None: unnamed). Keep it
    until its message is in: ctx.destroy() closes it."""
    sock = ctx.socket(zmq.PUSH)
    if incarnation is not None:
        sock.setsockopt(zmq.METADATA, f"X-Incarnation:{incarnation}".encode())
    sock.connect(address)
    return sock


def test_tokens_of_a_replaced_process_do_not_move_the_new_ones_sequence():
    with GatewayServer() as gw:
        registry = gw.gateway.registry
        first = gw.worker(worker_id="w0").start()
        assert first.ready.wait(5)
        old_incarnation = registry.get("w0").incarnation
        first.stop()
        second = gw.worker(worker_id="w0").start()
        assert second.ready.wait(5)
        assert wait_until(lambda: registry.get("w0").hello.pid == second.pid, 5)
        new_incarnation = registry.get("w0").incarnation
        assert new_incarnation != old_incarnation
        seen: list[int] = []
        on_tokens = registry.on_tokens
        # Noted once handled (the gateway's thread may be switched out between the two, and
        # a note made first let the test read tokens_seq before it was set).
        registry.on_tokens = lambda wid, seq, now: (on_tokens(wid, seq, now), seen.append(seq))
        ctx = zmq.Context()
        try:
            tokens_address = gw.config.endpoints[1]
            # The dead process's last TOKENS, still queued: a high sequence number.
            old = push_as(ctx, tokens_address, old_incarnation)
            old.send_multipart(encode(Tokens("w0", 900, [], seq=5000)))
            assert wait_until(lambda: len(seen) == 1, 5)
            assert registry.get("w0").tokens_seq == 0
            # The bound process's own TOKENS move it, as before.
            new = push_as(ctx, tokens_address, new_incarnation)
            new.send_multipart(encode(Tokens("w0", 3, [], seq=3)))
            assert wait_until(lambda: len(seen) == 2, 5)
            assert registry.get("w0").tokens_seq == 3
            # A sender that does not name its process (an older worker) is taken at its word.
            unnamed = push_as(ctx, tokens_address, None)
            unnamed.send_multipart(encode(Tokens("w0", 4, [], seq=4)))
            assert wait_until(lambda: len(seen) == 3, 5)
            assert registry.get("w0").tokens_seq == 4
        finally:
            ctx.destroy(linger=0)
            second.stop()
