"""The debug API (/admin/debug/*) and `zeroserve debug ...` against the real app on uvicorn,
with a real worker loop (a scripted engine) on the real sockets: the gateway's own stacks
list its asyncio tasks; a worker's stacks come back while its engine thread is blocked;
profiles are one at a time (409); the memory view shows a deliberate allocation; bad input
is a 400 naming the field; only an admin key (or a loopback client when none is set) may
call it."""

from __future__ import annotations

import json
import threading
import tracemalloc

import httpx
import pytest
from click.testing import CliRunner

from tests.gateway.helpers import GatewayServer, wait_until
from tests.gateway.http.test_admin_access import assert_error, bearer, this_hosts_address
from tests.worker.test_process import RunningWorker, ScriptedEngine
from zeroserve.cli import main as cli
from zeroserve.common.protocol import Shutdown
from zeroserve.worker.config import WorkerConfig

# What a keyless admin GET needs beside a loopback Host (a header no web page can send).
ADMIN = {"X-Zeroserve-Admin": "1"}

WORKER = "worker-0"


class Served:
    """One gateway (all interfaces, no admin key) and one worker loop, shared by the module."""

    def __init__(self) -> None:
        self.gw = GatewayServer(uvicorn_overrides={"host": "0.0.0.0"}, host="0.0.0.0")
        self.engine = ScriptedEngine(step_s=0.002)

    def __enter__(self) -> Served:
        self.gw.__enter__()
        router, tokens = self.gw.config.endpoints
        self.worker = RunningWorker(WorkerConfig(
            worker_id=WORKER, router_address=router, tokens_address=tokens,
            heartbeat_interval_s=0.05, stall_timeout_s=None), self.engine)
        assert wait_until(lambda: httpx.get(self.url + "/health").status_code == 200, 10)
        return self

    def __exit__(self, *exc) -> None:
        edge = self.gw.gateway.edge  # the gateway's loop owns its sockets
        self.gw.loop.call_soon_threadsafe(edge.send, WORKER, Shutdown("test over"))
        self.worker.wait()
        self.gw.__exit__(*exc)

    @property
    def url(self) -> str:
        return self.gw.url


@pytest.fixture(scope="module")
def served():
    with Served() as s:
        yield s


def test_the_gateway_lists_its_threads_and_asyncio_tasks(served):
    r = httpx.get(served.url + "/admin/debug/stacks", headers=ADMIN)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["process"] == "gateway"
    tasks = {t["name"]: t for t in answer["tasks"]}
    assert tasks["heartbeat"]["coro"] == "Gateway._heartbeat_loop"
    assert tasks["heartbeat"]["frames"][-1]["function"] == "Gateway._heartbeat_loop"
    assert any(t["is_current"] for t in answer["tasks"])  # this very request's task
    assert any(t["is_current"] for t in answer["threads"])
    plain = httpx.get(served.url + "/admin/debug/stacks", headers=ADMIN, params={"format": "text"})
    assert plain.headers["content-type"].startswith("text/plain")
    assert 'Task "heartbeat" (pending) Gateway._heartbeat_loop' in plain.text
    assert_error(httpx.get(served.url + "/admin/debug/stacks", headers=ADMIN, params={"format": "svg"}), 400,
                 None)
    text = CliRunner().invoke(cli.main, ["debug", "stacks", "--url", served.url])
    assert text.exit_code == 0, text.output
    assert 'Task "heartbeat" (pending) Gateway._heartbeat_loop' in text.output


def engine_blocked_by_the_http_test(entered: threading.Event, release: threading.Event):
    entered.set()
    release.wait(20)


def test_a_worker_answers_for_its_stacks_while_its_engine_thread_is_blocked(served):
    entered, release = threading.Event(), threading.Event()
    served.engine.step_hook = lambda: engine_blocked_by_the_http_test(entered, release)
    try:
        with httpx.stream("POST", served.url + "/v1/completions", timeout=30, json={
                "prompt": "hi", "max_tokens": 4, "stream": True}):
            assert entered.wait(5)
            r = httpx.get(served.url + "/admin/debug/stacks", headers=ADMIN, params={"worker": WORKER})
            assert r.status_code == 200, r.text
            assert r.json()["worker_id"] == WORKER
            assert any(f["function"] == "engine_blocked_by_the_http_test"
                       for t in r.json()["threads"] for f in t["frames"])
            out = CliRunner().invoke(cli.main, ["debug", "stacks", "--worker", WORKER,
                                                "--url", served.url])
            assert out.exit_code == 0, out.output
            assert "in engine_blocked_by_the_http_test" in out.output
            release.set()
    finally:
        release.set()


def test_a_second_profile_of_one_process_is_a_409(served):
    for worker in (None, WORKER):
        which = {"worker": worker} if worker else {}
        first = threading.Thread(target=lambda which=which: httpx.post(
            served.url + "/admin/debug/profile", timeout=30, json={"seconds": 1.0, **which}))
        first.start()
        try:
            def sampling(which=which) -> bool:
                threads = httpx.get(served.url + "/admin/debug/stacks", headers=ADMIN,
                                    params=which).json()["threads"]
                return any(f["function"] == "SamplingProfiler.run"
                           for t in threads for f in t["frames"])
            assert wait_until(sampling, 5)
            r = httpx.post(served.url + "/admin/debug/profile", json={"seconds": 0.01, **which})
            assert_error(r, 409, "debug_busy")
        finally:
            first.join()


def test_profiles_in_their_formats_from_the_http_api_and_the_cli(served, tmp_path):
    r = httpx.post(served.url + "/admin/debug/profile", timeout=30,
                   json={"seconds": 0.3, "worker": WORKER, "format": "collapsed"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert all(line.rsplit(" ", 1)[1].isdigit() for line in r.text.splitlines())
    assert "WorkerLoop.run (worker/process.py)" in r.text
    output = tmp_path / "gateway.collapsed"
    out = CliRunner().invoke(cli.main, ["debug", "profile", "--seconds", "0.3", "--format",
                                        "collapsed", "--output", str(output), "--url",
                                        served.url])
    assert out.exit_code == 0, out.output
    assert "BaseEventLoop.run_forever (asyncio/base_events.py)" in output.read_text()
    out = CliRunner().invoke(cli.main, ["debug", "profile", "--seconds", "0.3", "--worker",
                                        WORKER, "--url", served.url])
    assert out.exit_code == 0, out.output
    assert out.output.startswith(f"# {WORKER}: ") and "self%" in out.output
    out = CliRunner().invoke(cli.main, ["debug", "profile", "--seconds", "0.2", "--json",
                                        "--url", served.url])
    assert out.exit_code == 0 and '"collapsed"' in out.output


def allocated_by_the_http_test() -> list[bytes]:
    return [bytes(4096) + bytes([i % 256]) for i in range(800)]


def test_the_gateway_memory_view_names_a_deliberate_allocation(served):
    kept: list[bytes] = []
    timer = threading.Thread(target=lambda: wait_until(tracemalloc.is_tracing)
                             and kept.extend(allocated_by_the_http_test()))
    timer.start()
    r = httpx.post(served.url + "/admin/debug/memory", timeout=30,
                   json={"action": "diff", "seconds": 0.8, "limit": 10})
    timer.join()
    assert r.status_code == 200, r.text
    line = allocated_by_the_http_test.__code__.co_firstlineno + 1
    assert any(site["site"].endswith(f"test_debug.py:{line}") for site in r.json()["sites"]), r.json()["sites"][:3]
    r = httpx.post(served.url + "/admin/debug/memory", json={"action": "snapshot"})
    assert_error(r, 400, None)  # not started


def test_a_memory_stop_during_a_diff_is_a_409_and_the_diff_answers(served):
    """`zeroserve debug memory --action stop` while a `diff` runs was a 500 for the diff."""
    diff = {}
    caller = threading.Thread(target=lambda: diff.update(response=httpx.post(
        served.url + "/admin/debug/memory", timeout=60, json={"action": "diff", "seconds": 5})))
    caller.start()
    try:
        assert wait_until(tracemalloc.is_tracing, 30)
        r = httpx.post(served.url + "/admin/debug/memory", json={"action": "stop"})
        assert_error(r, 409, "debug_busy")
        assert "memory diff is running" in r.json()["error"]["message"]
    finally:
        caller.join()
    assert diff["response"].status_code == 200, diff["response"].text
    assert diff["response"].json()["action"] == "snapshot" and not tracemalloc.is_tracing()


@pytest.mark.parametrize("path, body, param", [
    ("/admin/debug/profile", {"seconds": 301}, "seconds"),
    ("/admin/debug/profile", {"seconds": "5"}, "seconds"),
    ("/admin/debug/profile", {"hz": 0}, "hz"),
    ("/admin/debug/profile", {"format": "svg"}, "format"),
    ("/admin/debug/profile", {"sekonds": 5}, "sekonds"),
    ("/admin/debug/profile", {"worker": 5}, "worker"),
    ("/admin/debug/memory", {"action": "leak"}, "action"),
    ("/admin/debug/memory", {"limit": 100_000}, "limit"),
    ("/admin/debug/torch-profile", {"seconds": 1}, "worker"),
    ("/admin/debug/torch-profile", {"worker": WORKER, "seconds": -1}, "seconds"),
])
def test_bad_arguments_are_a_400_naming_the_field(served, path, body, param):
    r = httpx.post(served.url + path, json=body)
    assert_error(r, 400, None)
    assert r.json()["error"]["param"] == param


def test_an_unknown_worker_is_a_404_and_a_non_object_body_a_400(served):
    r = httpx.get(served.url + "/admin/debug/stacks", headers=ADMIN, params={"worker": "nobody"})
    assert_error(r, 404, "worker_not_found")
    assert_error(httpx.post(served.url + "/admin/debug/profile", json=[1]), 400, None)
    assert_error(httpx.post(served.url + "/admin/debug/profile", content=b"{",
                            headers={"content-type": "application/json"}), 400, None)
    out = CliRunner().invoke(cli.main, ["debug", "stacks", "--worker", "nobody", "--url",
                                        served.url])
    assert out.exit_code == 1 and "404" in out.output


def test_without_an_admin_key_only_loopback_clients_may_look(served):
    address = this_hosts_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address to connect from")
    remote = f"http://{address}:{served.gw.port}"
    assert_error(httpx.get(remote + "/admin/debug/stacks"), 403, "admin_forbidden")
    assert_error(httpx.post(remote + "/admin/debug/profile", json={"seconds": 0.1}), 403,
                 "admin_forbidden")
    # Nor a web page on this machine, nor a proxied request.
    assert_error(httpx.get(served.url + "/admin/debug/stacks",
                           headers={"Origin": "http://evil.example"}), 403,
                 "cross_origin_forbidden")
    assert_error(httpx.get(served.url + "/admin/debug/stacks",
                           headers={"X-Forwarded-For": "203.0.113.7"}), 403, "admin_forbidden")


def test_with_an_admin_key_only_that_key_may_look():
    with GatewayServer(api_keys=("sk-serve",), admin_keys=("sk-admin",)) as gw:
        for headers in ({}, bearer("sk-serve"), bearer("sk-wrong")):
            assert_error(httpx.get(gw.url + "/admin/debug/stacks", headers=headers), 401,
                         "invalid_admin_key")
            assert_error(httpx.post(gw.url + "/admin/debug/profile", headers=headers,
                                    json={"seconds": 0.1}), 401, "invalid_admin_key")
        r = httpx.get(gw.url + "/admin/debug/stacks", headers=bearer("sk-admin"))
        assert r.status_code == 200 and r.json()["process"] == "gateway"
        out = CliRunner().invoke(cli.main, ["debug", "stacks", "--url", gw.url],
                                 env={"ZEROSERVE_ADMIN_KEY": None})
        assert out.exit_code == 1 and "401" in out.output
        out = CliRunner().invoke(cli.main, ["debug", "stacks", "--url", gw.url, "--json",
                                            "--admin-key", "sk-admin"])
        assert out.exit_code == 0 and '"tasks"' in out.output


@pytest.mark.slow  # the first torch profile in a process imports torch (seconds here)
def test_a_worker_torch_profile_comes_back_as_a_chrome_trace(served, tmp_path):
    r = httpx.post(served.url + "/admin/debug/torch-profile", timeout=120,
                   json={"worker": WORKER, "seconds": 0.3})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert isinstance(answer["trace"]["traceEvents"], list)  # JSON, not JSON in a string
    assert answer["num_iterations"] > 0 and answer["trace_bytes"] > 0
    output = tmp_path / "trace.json"
    out = CliRunner().invoke(cli.main, ["debug", "torch-profile", "--worker", WORKER,
                                        "--seconds", "0.2", "--output", str(output),
                                        "--url", served.url])
    assert out.exit_code == 0, out.output
    assert "traceEvents" in json.loads(output.read_text())
    out = CliRunner().invoke(cli.main, ["debug", "torch-profile", "--url", served.url])
    assert out.exit_code == 2 and "--worker" in out.output


def test_a_workers_torch_trace_is_parsed_and_written_off_the_event_loop(monkeypatch):
    """A worker's trace (up to 12 MiB of JSON text) was parsed on a thread but serialised
    again on the event loop, which then stalled every stream for as long. Both now run off
    the loop: no JSON of that size is read or written on it."""
    import asyncio

    trace = json.dumps({"traceEvents": [{"name": "aten::mm", "ph": "X", "ts": i, "dur": 3}
                                        for i in range(60_000)]})
    assert len(trace) > 2**21
    on_loop = []

    def on_the_loop() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    real_dumps, real_loads = json.dumps, json.loads

    def dumps(obj, *args, **kwargs):
        text = real_dumps(obj, *args, **kwargs)
        if len(text) > 2**20 and on_the_loop():
            on_loop.append("dumps")
        return text

    def loads(text, *args, **kwargs):
        if len(text) > 2**20 and on_the_loop():
            on_loop.append("loads")
        return real_loads(text, *args, **kwargs)

    with GatewayServer() as gw:
        async def call(worker_id, kind, args, timeout_s):
            return {"worker_id": worker_id, "seconds": 0.5, "num_iterations": 3,
                    "path": "/tmp/x.trace.json", "trace_bytes": len(trace), "trace": trace}

        monkeypatch.setattr(gw.gateway.debug_calls, "call", call)
        monkeypatch.setattr(json, "dumps", dumps)
        monkeypatch.setattr(json, "loads", loads)
        r = httpx.post(gw.url + "/admin/debug/torch-profile", timeout=60,
                       json={"worker": WORKER, "seconds": 0.5})
        monkeypatch.undo()
        assert r.status_code == 200, r.text
        assert r.json()["trace"]["traceEvents"][-1]["ts"] == 59_999
        assert on_loop == []

        async def not_json(worker_id, kind, args, timeout_s):
            return {"worker_id": worker_id, "trace": '{"traceEvents": [NaN'}

        monkeypatch.setattr(gw.gateway.debug_calls, "call", not_json)
        r = httpx.post(gw.url + "/admin/debug/torch-profile", json={"worker": WORKER})
        assert_error(r, 502, "debug_failed")
