"""Small clients for end-to-end tests: SSE streams read (or not read) the way real clients do."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class StreamResult:
    chunks: list[dict] = field(default_factory=list)  # parsed `data:` events, [DONE] excluded
    error: dict | None = None  # the error event, if one came
    is_done: bool = False  # saw [DONE]
    exception: BaseException | None = None
    elapsed_s: float = 0.0
    ended_at: float = 0.0  # time.monotonic() when the stream ended

    @property
    def text(self) -> str:
        parts = []
        for chunk in self.chunks:
            for choice in chunk.get("choices", []):
                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        return "".join(parts)

    @property
    def finish_reason(self) -> str | None:
        for chunk in reversed(self.chunks):
            for choice in chunk.get("choices", []):
                if choice.get("finish_reason"):
                    return choice["finish_reason"]
        return None

    @property
    def usage(self) -> dict | None:
        for chunk in reversed(self.chunks):
            if chunk.get("usage"):
                return chunk["usage"]
        return None


def stream_completion(base_url: str, body: dict, result: StreamResult | None = None,
                      stop_after: int | None = None, on_chunk=None,
                      timeout_s: float = 60.0, client: httpx.Client | None = None
                      ) -> StreamResult:
    """POST a streaming completion and read it to the end (or `stop_after` chunks, then hang
    up). `on_chunk(n)` is called after each chunk. `client`: send it on that client's
    (kept-alive) connection."""
    result = result or StreamResult()
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    started = time.monotonic()
    try:
        with (client or httpx).stream("POST", base_url + path, json={"model": MODEL, "stream": True, **body},
                          timeout=timeout_s) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    result.is_done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = event["error"]
                    continue
                result.chunks.append(event)
                if on_chunk is not None:
                    on_chunk(len(result.chunks))
                if stop_after is not None and len(result.chunks) >= stop_after:
                    break  # leaving the block closes the connection mid-stream
    except BaseException as e:  # recorded for the test thread to assert on
        result.exception = e
    result.ended_at = time.monotonic()
    result.elapsed_s = result.ended_at - started
    return result


def stream_in_thread(base_url: str, body: dict, **kwargs) -> tuple[threading.Thread, StreamResult]:
    result = StreamResult()
    thread = threading.Thread(target=stream_completion, args=(base_url, body, result),
                              kwargs=kwargs, daemon=True)
    thread.start()
    return thread, result


class NonReadingClient:
    """Sends a streaming request over a socket with a tiny receive buffer and reads nothing,
    like a client on a stalled network."""

    def __init__(self, port: int, path: str, body: dict):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        payload = json.dumps({"model": MODEL, "stream": True, **body}).encode()
        self.sock.sendall(
            f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n".encode() + payload
        )

    def read_all(self, timeout_s: float = 5.0) -> bytes:
        """Everything the server sent, until it closes or goes quiet for a second."""
        self.sock.settimeout(1.0)
        data = b""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                break
            if not chunk:
                break
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


def is_idle(workers: list[dict]) -> bool:
    """No sequence held anywhere and every KV block back in the free pool."""
    return bool(workers) and all(
        w["num_running"] == 0 and w["num_waiting"] == 0 and w["num_paused"] == 0
        and w["num_free_blocks"] == w["num_total_blocks"] for w in workers
    )
