"""A stand-in for the gateway's health endpoints: answers what a test sets."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubGateway:
    def __init__(self) -> None:
        self.live: dict | None = {"status": "ok", "pid": 100}
        self.health = {"status": "ok", "workers": []}
        self.health_status = 200
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/health/live" and stub.live is not None:
                    self._answer(200, stub.live)
                elif self.path == "/health":
                    self._answer(stub.health_status, stub.health)
                else:
                    self._answer(404, {})

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
