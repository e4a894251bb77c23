"""Liveness below our own heartbeats: options every worker-plane socket gets, both sides.

Our HEARTBEAT messages say whether a peer's *process* makes progress; they cannot tell
libzmq that a *connection* is dead. After a partition, a power-cut host or a SIGSTOPped peer,
a TCP connection can stay half-open for hours: the gateway's ROUTER still holds the dead
connection under the worker's route, and a worker that reconnects with that same route would
be ignored (libzmq refuses a second connection with a routing id it already holds) unless
the ROUTER has ROUTER_HANDOVER (gateway/workers/zmq_io.py). These options make sure the dead
connection goes away too:

- ZMTP heartbeats (ZMQ_HEARTBEAT_IVL/TIMEOUT/TTL): libzmq's I/O thread pings every
  connection and closes one that is silent past the timeout; TTL asks the peer to do the
  same. They are answered by libzmq's I/O thread, not by our loops, so a busy event loop or
  a long engine step never trips them; a stopped or vanished process does.
- TCP keepalive (tcp:// only; harmless on ipc://): the kernel's own probe for a peer host
  that is gone, for paths where nothing is sent.

A closed connection is reopened by the connecting side (the worker) with its same route,
and the DEALER's HELLO retry (worker/link.py) takes it from there.
"""

from __future__ import annotations

import zmq

# Generous on purpose: a connection whose reader is stalled (a queue at its high-water mark
# stops libzmq reading it) must not be cut by its own backlog; a peer gone for a minute is
# gone.
ZMTP_HEARTBEAT_IVL_MS = 5_000  # a PING on a connection this often
ZMTP_HEARTBEAT_TIMEOUT_MS = 60_000  # no traffic at all for this long: close the connection
ZMTP_HEARTBEAT_TTL_MS = 60_000  # what we ask the peer to wait for us before it closes
TCP_KEEPALIVE_IDLE_S = 30
TCP_KEEPALIVE_INTVL_S = 10
TCP_KEEPALIVE_CNT = 3


def set_liveness_options(sock: zmq.Socket) -> None:
    """Before connect/bind: ZMTP heartbeats and TCP keepalive on a worker-plane socket."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, ZMTP_HEARTBEAT_TTL_MS)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, TCP_KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, TCP_KEEPALIVE_CNT)
