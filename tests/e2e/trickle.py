"""A client that reads its stream a few bytes at a time: the slow reader a server must bound."""

from __future__ import annotations

import json
import socket
import threading
import time


class TrickleClient:
    """A streaming request over a raw socket with a tiny receive buffer, read `num_bytes` at a
    time every `every_s` seconds on a thread of its own."""

    def __init__(self, port: int, path: str, body: dict, num_bytes: int, every_s: float):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        payload = json.dumps({"stream": True, **body}).encode()
        self.sock.sendall(
            f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
            .encode() + payload)
        self.received = bytearray()
        self.is_closed_by_server = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, args=(num_bytes, every_s),
                                        daemon=True)
        self._thread.start()

    def _trickle(self, num_bytes: int, every_s: float) -> None:
        self.sock.settimeout(every_s)
        while not self._stop.is_set():
            try:
                data = self.sock.recv(num_bytes)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                self.is_closed_by_server = True
                return
            self.received += data
            time.sleep(every_s)

    def drain(self, timeout_s: float = 5.0) -> bytes:
        """Stop trickling and read the rest at full speed, until the server closes."""
        self._stop.set()
        self._thread.join()
        self.sock.settimeout(1.0)
        deadline = time.monotonic() + timeout_s
        while not self.is_closed_by_server and time.monotonic() < deadline:
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                break
            if not data:
                self.is_closed_by_server = True
                break
            self.received += data
        return bytes(self.received)

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
