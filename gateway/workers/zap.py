"""The gateway's ZAP handler: which CURVE peers may complete a handshake, and as whom.

ZeroMQ asks the handler at `inproc://zeromq.zap.01` about every connection to a socket with
a ZAP domain. We allow a peer only if its public key is on the allow-list, and we answer
with the worker id that key was issued for as the connection's User-Id. Every message then
carries that User-Id, so the gateway can check that a worker speaks only as itself (the
routing id and the worker id in a message are the peer's own claims; the User-Id is not).

The handler runs on a thread of its own with a plain socket on the gateway's context, so
handshakes never wait on the event loop.
"""

from __future__ import annotations

import threading

import zmq
from zmq.utils import z85

from zeroserve.common.logging_setup import RateLimited, printable
from zeroserve.gateway.logging import get_logger

log = get_logger("zap")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"zeroserve"
_VERSION = b"1.0"


class ZapHandler(threading.Thread):
    def __init__(self, ctx: zmq.Context, allowed: dict[bytes, str]):
        super().__init__(name="zap", daemon=True)
        self.allowed = dict(allowed)  # Z85 public key -> worker id
        self._socket = zmq.Context.shadow(ctx.underlying).socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(ZAP_ENDPOINT)  # before any CURVE socket binds: none slips past
        self._stopping = threading.Event()
        self.num_denied = 0
        self._warn = RateLimited()

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                if self._socket.poll(200):
                    request = self._socket.recv_multipart()
                    try:
                        answer = self._answer(request)
                    except Exception:  # never let a bad request end the handler: deny it
                        log.exception("ZAP request failed")
                        answer = [_VERSION, request[1] if len(request) > 1 else b"", b"500",
                                  b"internal error", b"", b""]
                    self._socket.send_multipart(answer)
        finally:
            self._socket.close(linger=0)

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=2)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6:
            return [_VERSION, b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism, *credentials = request
        worker_id = None
        if (version == _VERSION and domain == ZAP_DOMAIN and mechanism == b"CURVE"
                and len(credentials) == 1):
            worker_id = self.allowed.get(z85.encode(credentials[0]))
        if worker_id is None:
            self.num_denied += 1
            peer = printable(address.decode(errors="replace"))
            num_held = self._warn.allow(peer)
            if num_held is not None:
                log.warning("refused a peer: its key is not on the allow-list",
                            extra={"peer_address": peer, "num_refused_since": num_held})
            return [_VERSION, request_id, b"400", b"not allowed", b"", b""]
        return [_VERSION, request_id, b"200", b"OK", worker_id.encode(), b""]
