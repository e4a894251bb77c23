"""POST /v1/completions and /v1/chat/completions take the short way past Starlette's router
(gateway/http/direct_routes.py): the same answers, the router not involved; every other
route, method or a root_path still goes through the router."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from tests.gateway.helpers import GatewayServer, cyclic_reply, wait_until
from zeroserve.gateway.http.direct_routes import DirectRoutes

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def served():
    with GatewayServer() as gw:
        worker = gw.worker(reply=cyclic_reply("ab")).start()
        assert worker.ready.wait(5)
        yield gw, worker
        worker.stop()


@pytest.fixture
def routed(served):
    """Counts the requests Starlette's router handles, while the test runs."""
    gw, _ = served
    router = gw.app.router
    original = router.middleware_stack
    paths = []

    async def counting(scope, receive, send):
        paths.append(scope.get("path"))
        await original(scope, receive, send)

    router.middleware_stack = counting
    yield paths
    router.middleware_stack = original


def data_events(response: httpx.Response) -> list:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_generation_posts_are_answered_without_the_router(served, routed):
    gw, _ = served
    with httpx.stream("POST", gw.url + "/v1/completions", json={
            "model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        events = data_events(r)
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2]) == "aba"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 3
    assert events[-1] == "[DONE]"
    r = httpx.post(gw.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ab"
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x",
                                                     "max_tokens": -1}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert routed == []
    assert wait_until(lambda: len(gw.gateway.streams) == 0, 5)


def test_other_routes_and_methods_still_go_through_the_router(served, routed):
    gw, _ = served
    assert httpx.get(gw.url + "/v1/models", timeout=10).status_code == 200
    r = httpx.get(gw.url + "/v1/completions", timeout=10)
    assert r.status_code == 405
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(gw.url + "/v1/completions/", json={}, timeout=10).status_code != 200
    assert routed[:2] == ["/v1/models", "/v1/completions"]


def asgi_call(app, scope: dict) -> list[dict]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": "POST", "headers": [], "query_string": b"",
                     **scope}, receive, send))
    return sent


def test_an_http_exception_gets_the_apps_handler():
    async def handler(request):
        raise HTTPException(413, "too big")

    async def on_http_error(request, exc):
        return JSONResponse({"error": {"message": exc.detail}}, status_code=exc.status_code)

    async def router(scope, receive, send):
        raise AssertionError("the router was called")

    sent = asgi_call(DirectRoutes(router, {"/v1/completions": handler}, on_http_error),
                     {"path": "/v1/completions"})
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"]) == {"error": {"message": "too big"}}


def test_a_root_path_is_left_to_the_router():
    routed = []

    async def handler(request):
        raise AssertionError("the direct handler was called")

    async def router(scope, receive, send):
        routed.append(scope["path"])
        await JSONResponse({})(scope, receive, send)

    app = DirectRoutes(router, {"/v1/completions": handler}, on_http_error=None)
    asgi_call(app, {"path": "/v1/completions", "root_path": "/api"})
    asgi_call(app, {"path": "/v1/completions", "method": "PUT"})
    assert routed == ["/v1/completions", "/v1/completions"]
