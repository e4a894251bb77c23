"""Hostile HTTP input against the real app on uvicorn with the gateway's own protocol class:
every bad body is an OpenAI-shaped 4xx before any worker sees it, slow heads and bodies are
cut off, and a long prompt does not hold the event loop."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from tests.gateway.helpers import GatewayServer, cyclic_reply
from zeroserve.gateway.server import uvicorn_config

# The served fixture's 0.5 s header and body timeouts cut a connection off well within this
# (a generous deadline for a loaded machine), and the defaults (10 s, 30 s) would not.
CUT_OFF_WITHIN_S = 8.0

POST_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses",
              "/v1/responses/input_tokens", "/tokenize", "/detokenize"]


class GuardedServer(GatewayServer):
    """GatewayServer, served the way `zeroserve gateway` serves (gateway.server)."""

    def __init__(self, **overrides):
        super().__init__(**overrides)
        self.server = uvicorn.Server(uvicorn_config(self.app, self.config, host="127.0.0.1",
                                                    log_level="warning"))


@pytest.fixture(scope="module")
def served():
    with GuardedServer(max_request_body_bytes=64 * 1024, request_body_timeout_s=0.5,
                       header_timeout_s=0.5, max_tokens_limit=50) as gw:
        worker = gw.worker(reply=cyclic_reply("ab")).start()
        assert worker.ready.wait(5)
        yield gw, worker
        worker.stop()


def raw_exchange(gw, data: bytes, wait_s: float = 3.0) -> bytes:
    """Send raw bytes, then read until the server closes or goes quiet for `wait_s`."""
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        sock.sendall(data)
        sock.settimeout(wait_s)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        except ConnectionResetError:
            pass
        return out


def status_and_error(response: bytes) -> tuple[int, dict | None]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    try:
        return status, json.loads(body)["error"]
    except ValueError:
        return status, None


def assert_4xx(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("path", POST_PATHS)
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_json_body_needs_a_json_content_type(served, path, content_type):
    gw, _ = served
    headers = {} if content_type is None else {"content-type": content_type}
    r = httpx.post(gw.url + path, content=b'{"prompt": "x"}', headers=headers)
    assert assert_4xx(r, 415)["code"] == "unsupported_media_type"


def test_json_with_charset_is_fine(served):
    gw, _ = served
    r = httpx.post(gw.url + "/tokenize", content=b'{"prompt": "hi"}',
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and r.json()["tokens"] == list(b"hi")


def test_a_declared_body_over_the_limit_is_413_before_it_is_sent(served):
    gw, worker = served
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json"
            b"\r\ncontent-length: 31457280\r\n\r\n")  # 30 MB, none of it sent
    status, error = status_and_error(raw_exchange(gw, head))
    assert status == 413 and error["code"] == "request_too_large"


def test_a_streamed_body_over_the_limit_is_413(served):
    gw, _ = served

    def chunks():
        for _ in range(100):
            yield b" " * 1024  # whitespace: valid JSON padding, 100 KiB in all

    try:
        r = httpx.post(gw.url + "/v1/completions", content=chunks(),
                       headers={"content-type": "application/json"})
    except httpx.TransportError:
        pytest.skip("the server closed before the client read its answer")
    assert assert_4xx(r, 413)["code"] == "request_too_large"


def test_a_slow_body_is_408(served):
    gw, _ = served
    started = time.monotonic()
    out = raw_exchange(gw, b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\n"
                           b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{",
                       wait_s=CUT_OFF_WITHIN_S + 1)
    status, error = status_and_error(out)
    assert status == 408 and error["code"] == "request_body_timeout"
    assert time.monotonic() - started < CUT_OFF_WITHIN_S


@pytest.mark.parametrize("data", [b"", b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\n"])
def test_a_slow_head_closes_the_connection(served, data):
    gw, _ = served
    started = time.monotonic()
    assert raw_exchange(gw, data, wait_s=CUT_OFF_WITHIN_S + 1) == b""
    # Closed by the 0.5 s header timeout: nothing else closes a silent connection this soon.
    assert 0.4 < time.monotonic() - started < CUT_OFF_WITHIN_S


def test_a_head_trickled_in_is_cut_at_the_deadline(served):
    gw, _ = served
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        started = time.monotonic()
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            while time.monotonic() - started < CUT_OFF_WITHIN_S + 1:
                sock.sendall(b"x-slow: 1\r\n")
                time.sleep(0.05)
        assert time.monotonic() - started < CUT_OFF_WITHIN_S


def test_the_header_timer_allows_keep_alive_requests(served):
    gw, _ = served
    with httpx.Client(base_url=gw.url) as client:
        for _ in range(3):
            assert client.get("/v1/models").status_code == 200
            time.sleep(0.3)  # idle between requests is keep-alive's business, not ours
        assert client.get("/v1/models").status_code == 200


def test_a_huge_head_is_431(served):
    gw, _ = served
    head = b"GET /health HTTP/1.1\r\nhost: localhost\r\nx-big: " + b"a" * 200_000 + b"\r\n\r\n"
    status, _ = status_and_error(raw_exchange(gw, head))
    assert status == 431


HOSTILE_BODIES = [
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    (b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", None),
    (b'{"prompt": "x", "top_k": 18446744073709551616}', "top_k"),
    (b'{"prompt": "x", "top_k": 9223372036854775808}', "top_k"),
    (b'{"prompt": "x", "stop_token_ids": [18446744073709551616]}', "stop_token_ids"),
    (b'{"prompt": "x", "stop_token_ids": [258]}', "stop_token_ids"),
    (b'{"prompt": "a\\ud800"}', None),
    (b'{"model": "\\udc00", "prompt": "x"}', None),
    (b'{"prompt": "x", "stop": ["\\ud83d"]}', None),
    (b'{"prompt": "x", "max_tokens": 51}', "max_tokens"),
    (b'{"prompt": "x", "repetition_penalty": 1e-300}', "repetition_penalty"),
    (b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
]


@pytest.mark.parametrize(("raw", "param"), HOSTILE_BODIES)
def test_hostile_completion_bodies_are_400(served, raw, param):
    gw, worker = served
    num_submits = len(worker.submits)
    r = httpx.post(gw.url + "/v1/completions", content=raw,
                   headers={"content-type": "application/json"})
    assert assert_4xx(r, 400)["param"] == param
    assert len(worker.submits) == num_submits


def test_hostile_chat_bodies_are_400(served):
    gw, _ = served
    for raw in (b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                b'{"messages": [{"role": "user", "content": "x"}], "top_k": ' + b"9" * 30
                + b"}"):
        r = httpx.post(gw.url + "/v1/chat/completions", content=raw,
                       headers={"content-type": "application/json"})
        assert_4xx(r, 400)


def test_chat_default_max_tokens_is_capped(served):
    gw, worker = served
    r = httpx.post(gw.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert worker.submits[-1].params["max_tokens"] == 50
    assert r.json()["usage"]["completion_tokens"] == 50


def test_top_k_beyond_the_vocabulary_means_off(served):
    gw, worker = served
    r = httpx.post(gw.url + "/v1/completions", json={"prompt": "x", "top_k": 100_000,
                                                     "max_tokens": 2})
    assert r.status_code == 200 and worker.submits[-1].params["top_k"] == 0


def test_a_tiny_temperature_is_greedy(served):
    gw, worker = served
    r = httpx.post(gw.url + "/v1/completions", json={"prompt": "x", "temperature": 1e-9,
                                                     "max_tokens": 2})
    assert r.status_code == 200 and worker.submits[-1].params["temperature"] == 0.0


def test_too_many_engine_requests_is_400(served):
    gw, _ = served
    r = httpx.post(gw.url + "/v1/completions", json={"prompt": ["a", "b", "c"], "n": 100})
    assert assert_4xx(r, 400)["param"] == "n"


@pytest.mark.slow
def test_a_million_character_prompt_does_not_hold_the_loop():
    """/tokenize of a 1M-character prompt with the real tokenizer (about a second to encode):
    the encode runs on another thread than the server's event loop, and a ticker on that loop
    keeps counting while it runs (the tokenizer releases the GIL). Counts and thread identity,
    no latency bound: a loaded machine slows the loop down but cannot fail this."""
    from zeroserve.gateway.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("default")
    encode = tokenizer.encode
    num_ticks = 0
    long_encodes: list[tuple[int, int]] = []  # (thread, loop ticks while it ran)

    def watched_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < 100_000:
            return encode(text, add_special_tokens)
        ticks_before = num_ticks
        ids = encode(text, add_special_tokens)
        long_encodes.append((threading.get_ident(), num_ticks - ticks_before))
        return ids

    tokenizer.encode = watched_encode
    with GuardedServer(tokenizer=tokenizer, max_tokens_limit=50) as gw:
        stop = threading.Event()

        async def loop_thread() -> int:
            return threading.get_ident()

        async def ticker() -> None:
            nonlocal num_ticks
            while not stop.is_set():
                await asyncio.sleep(0.005)
                num_ticks += 1

        loop_ident = asyncio.run_coroutine_threadsafe(loop_thread(), gw.loop).result(10)
        future = asyncio.run_coroutine_threadsafe(ticker(), gw.loop)
        prompt = ("Hello world, a long prompt. 日本語 😀 " * 40_000)[:1_000_000]
        r = httpx.post(gw.url + "/tokenize", json={"prompt": prompt}, timeout=120)
        stop.set()
        future.result(10)
    assert r.status_code == 200 and r.json()["count"] > 100_000
    [(thread, ticks_during)] = long_encodes
    assert thread != loop_ident, "the prompt was encoded on the event loop's thread"
    # A 5 ms ticker counts ~200 in a second of encoding (~500 measured); an encode that holds
    # the GIL (or the loop) lets it count a tick or two at the edges of the call (2 measured).
    assert ticks_during >= 20, f"the loop counted {ticks_during} ticks during the encode"
