"""A local stand-in for the Hugging Face Hub's HTTP endpoint, enough for huggingface_hub's
snapshot_download and hf_hub_download (point HF_ENDPOINT at it):

- GET /api/models/{repo}/revision/{rev}: the repository's info (its commit sha)
- GET /api/models/{repo}/tree/{rev}[/path]: the file list
- HEAD/GET /{repo}/resolve/{rev}/{file}: the file, with X-Repo-Commit, ETag, Content-Length

It counts requests by path, so a test can tell whether a file was downloaded once.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubStandIn:
    def __init__(self, repos: dict[str, Path]):
        """repos: "org/name" -> a folder whose files make up the repository."""
        self.repos = repos
        self.requests: Counter[tuple[str, str]] = Counter()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloads(self, filename: str) -> int:
        return sum(n for (method, path), n in self.requests.items()
                   if method == "GET" and path.endswith("/" + filename))

    def _files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _send(self, status: int, payload: bytes, headers: dict[str, str],
                      body: bool) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if body:
                    self.wfile.write(payload)

            def _json(self, value, body: bool) -> None:
                self._send(200, json.dumps(value).encode(),
                           {"Content-Type": "application/json"}, body)

            def _missing(self, body: bool) -> None:
                self._send(404, b'{"error": "Repository not found"}',
                           {"Content-Type": "application/json",
                            "X-Error-Code": "RepoNotFound"}, body)

            def _serve(self, body: bool) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests[(self.command, path)] += 1
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 6:
                    repo = "/".join(parts[2:4])
                    if repo not in hub.repos:
                        return self._missing(body)
                    files = hub._files(repo)
                    if parts[4] == "revision":
                        return self._json({"id": repo, "modelId": repo, "sha": COMMIT,
                                           "private": False,
                                           "siblings": [{"rfilename": f} for f in files]}, body)
                    if parts[4] == "tree":
                        return self._json([
                            {"type": "file", "path": name, "size": p.stat().st_size,
                             "oid": hashlib.sha1(p.read_bytes()).hexdigest()}
                            for name, p in files.items()], body)
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo, name = "/".join(parts[:2]), "/".join(parts[4:])
                    files = hub._files(repo) if repo in hub.repos else {}
                    if name not in files:
                        return self._missing(body)
                    data = files[name].read_bytes()
                    return self._send(200, data, {
                        "X-Repo-Commit": COMMIT,
                        "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                        "Content-Type": "application/octet-stream"}, body)
                return self._missing(body)

        return Handler
