"""Streamed outputs written from the receive loop (gateway/http/streaming.py's direct path), on
the product's uvicorn protocol: what a client reads is the same as through the response's
task, a stream whose socket backs up falls back to its task and loses nothing, and a bug
in one stream's direct write ends that stream only."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from tests.gateway.helpers import (
    GatewayServer,
    cyclic_reply,
    raw_completion,
    text_tokens,
    wait_until,
)
from zeroserve.gateway.http import sse as sse_module
from zeroserve.gateway.http import streaming

DIGITS = "0123456789"


def stream_text(url: str, body: dict) -> tuple[str, list[dict]]:
    """POST a streamed completion; (its text, every parsed event) up to [DONE]."""
    events, text = [], ""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                events.append({"done": True})
                break
            event = json.loads(line[6:])
            events.append(event)
            for choice in event.get("choices", []):
                text += choice.get("text", "")
    return text, events


def start_streams(url: str, bodies: list[dict]) -> tuple[list, list[threading.Thread]]:
    """Each body as a streamed completion on its own thread: (results, threads), a result
    being stream_text's (text, events) once its thread is done."""
    results: list[tuple[str, list[dict]]] = [("", [])] * len(bodies)

    def one(k: int) -> None:
        results[k] = stream_text(url, bodies[k])

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(bodies))]
    for t in threads:
        t.start()
    return results, threads


@pytest.fixture
def write_log(monkeypatch):
    """Every chunk SSEResponse.write_now put on a socket (the direct path's writes)."""
    chunks: list[bytes] = []
    lock = threading.Lock()
    original = sse_module.SSEResponse.write_now

    def write_now(self, chunk: bytes) -> None:
        with lock:
            chunks.append(chunk)
        original(self, chunk)

    monkeypatch.setattr(sse_module.SSEResponse, "write_now", write_now)
    return chunks


def test_concurrent_streams_are_written_directly_and_read_whole(write_log):
    with GatewayServer(credit_window=8) as gw:
        worker = gw.worker(reply=cyclic_reply(DIGITS), step_s=0.002).start()
        try:
            assert worker.ready.wait(5)
            results, threads = start_streams(
                gw.url, [{"prompt": f"p{k}", "max_tokens": 60} for k in range(8)])
            for t in threads:
                t.join(30)
            expected = (DIGITS * 6)[:60]
            for text, events in results:
                assert text == expected
                assert events[-2]["choices"][0]["finish_reason"] == "length"
                assert events[-1] == {"done": True}
            # Most chunks went out from the receive loop (the first and the last of each
            # stream go through its task).
            assert len(write_log) >= 8 * 40
        finally:
            worker.stop()


def test_a_backed_up_stream_falls_back_to_its_task_and_loses_nothing(write_log):
    """The client stops reading until the server's socket is full (writes would block, so
    the direct path must leave the chunks to the task), then reads everything."""
    with GatewayServer(credit_window=64) as gw:
        worker = gw.worker(reply=cyclic_reply(DIGITS * 20), step_s=0.001).start()
        try:
            assert worker.ready.wait(5)
            sock = raw_completion(gw.port, {"prompt": "x", "max_tokens": 3000, "stream": True},
                                  rcvbuf=4096)
            rid = gw.shrink_the_stream(worker)
            # Not reading: the stream pauses at its credit, with the socket backed up.
            assert wait_until(lambda: worker.num_sent.get(rid, 0) >= 64, 10)
            time.sleep(0.5)
            num_direct = len(write_log)
            raw = b""
            sock.settimeout(20)
            while b"data: [DONE]" not in raw:
                data = sock.recv(65536)
                if not data:
                    break
                raw += data
            sock.close()
            text = "".join(
                json.loads(line[6:])["choices"][0]["text"]
                for line in raw.decode().split("\n")
                if line.startswith('data: {"id"') and '"choices":[{' in line)
            assert text == (DIGITS * 20 * 15)[:3000]
            assert len(write_log) > num_direct  # the direct path resumed once it drained
        finally:
            worker.stop()


def test_a_stop_string_met_on_the_direct_path_ends_the_stream():
    with GatewayServer() as gw:
        worker = gw.worker(reply=cyclic_reply("abcdefghij"), step_s=0.002).start()
        try:
            assert worker.ready.wait(5)
            text, events = stream_text(gw.url, {"prompt": "x", "max_tokens": 200,
                                                "stop": ["fgh"]})
            assert text == "abcde"
            finishes = [c["finish_reason"] for e in events for c in e.get("choices", [])]
            assert finishes[-1] == "stop" and events[-1] == {"done": True}
            rid = worker.submits[0].request_id
            assert wait_until(lambda: rid in worker.aborts, 5)  # the worker stops too
        finally:
            worker.stop()


def test_a_failure_in_one_streams_direct_write_ends_only_that_stream(monkeypatch):
    original = streaming.StreamedResponse.render
    original_one = streaming.StreamedResponse._render_one  # the direct path's

    def render(self, batch):
        if any("!" in update.text for update, _ in batch):
            raise RuntimeError("a bug in one stream's rendering")
        return original(self, batch)

    def render_one(self, update):
        if "!" in update.text:
            raise RuntimeError("a bug in one stream's rendering")
        return original_one(self, update)

    monkeypatch.setattr(streaming.StreamedResponse, "render", render)
    monkeypatch.setattr(streaming.StreamedResponse, "_render_one", render_one)

    def is_bad(prompt: list[int]) -> bool:
        return b"bad" in bytes(t for t in prompt if t < 256)

    def reply(prompt: list[int], params: dict) -> list[int]:
        # The prompt "bad" gets a "!" after a few tokens; the others never do.
        return text_tokens("abc!defgh" * 20 if is_bad(prompt) else DIGITS * 20)

    with GatewayServer() as gw:
        worker = gw.worker(reply=reply, step_s=0.002).start()
        try:
            assert worker.ready.wait(5)
            results: dict[str, tuple[str, list[dict]]] = {}

            def one(prompt: str) -> None:
                try:
                    results[prompt] = stream_text(gw.url, {"prompt": prompt,
                                                           "max_tokens": 150})
                except (httpx.HTTPError, AssertionError) as e:
                    results[prompt] = (repr(e), [])

            threads = [threading.Thread(target=one, args=(p,))
                       for p in ("bad", "ok1", "ok2", "ok3")]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            for prompt in ("ok1", "ok2", "ok3"):
                text, events = results[prompt]
                assert text == (DIGITS * 20)[:150] and events[-1] == {"done": True}
            bad_text, bad_events = results["bad"]
            # It ended early, as a failure the client can read: an error event, then [DONE].
            assert "!" not in bad_text and len(bad_text) < 150
            assert bad_events[-2]["error"]["type"] == "server_error"
            assert bad_events[-1] == {"done": True}
            bad_id = next(s.request_id for s in worker.submits if is_bad(s.prompt_token_ids))
            assert wait_until(lambda: bad_id in worker.aborts, 5)  # and its work stopped
        finally:
            worker.stop()


def test_steps_waiting_behind_a_stalled_loop_go_out_merged_and_in_order(write_log):
    """The gateway's loop stalls while the worker keeps stepping: several TOKENS messages
    wait, and each stream then gets one write holding all of its new events."""
    with GatewayServer(credit_window=64) as gw:
        worker = gw.worker(reply=cyclic_reply(DIGITS), step_s=0.002).start()
        try:
            assert worker.ready.wait(5)
            results, threads = start_streams(
                gw.url, [{"prompt": f"p{k}", "max_tokens": 400} for k in range(4)])
            assert wait_until(lambda: len(worker.submits) == 4, 5)
            time.sleep(0.1)
            for _ in range(3):  # stall the loop (as a long GC pause would), three times
                assert gw.loop is not None
                gw.loop.call_soon_threadsafe(time.sleep, 0.1)
                time.sleep(0.2)
            for t in threads:
                t.join(30)
            for text, events in results:
                assert text == (DIGITS * 40)[:400] and events[-1] == {"done": True}
            assert any(chunk.count(b"data: ") > 1 for chunk in write_log)
        finally:
            worker.stop()


def test_the_direct_path_is_off_without_the_products_protocol():
    """Under a server that is not ours (no cycle in the scope) every chunk goes through
    ASGI send: the response still streams."""
    from zeroserve.gateway.http.sse import SSEResponse

    async def events():
        yield b"data: 1\n\n"
        yield b"data: 2\n\n"

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    response = SSEResponse(events(), 5.0, on_slow_client=lambda: b"")
    asyncio.run(response({"type": "http"}, receive, send))
    assert not response.can_write_now()
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b"data: 2\n\n", b""]
