"""A live look inside a worker over the wire (DEBUG_REQUEST -> DEBUG_REPLY), answered by its
link thread: stacks while the engine thread is blocked, a CPU profile of a busy worker that
names the model's forward, the torch profiler's trace of its steps, a memory view."""

from __future__ import annotations

import json
import threading
import tracemalloc

import pytest

from tests.gateway.helpers import wait_until
from tests.worker.test_process import FakeGateway, ScriptedEngine, start, stop
from zeroserve.common.protocol import DebugReply, DebugRequest, Submit
from zeroserve.worker import debug as debug_module
from zeroserve.worker.config import EngineConfig


@pytest.fixture
def gateway(tmp_path):
    gw = FakeGateway(tmp_path, "worker-test")
    yield gw
    gw.close()


def ask(gateway: FakeGateway, kind: str, timeout_s: float = 10.0, **args) -> DebugReply:
    token = f"{kind}-{len(args)}-{threading.get_ident()}"
    gateway.send(DebugRequest(token, kind, args))
    reply = gateway.recv(DebugReply, timeout_s)
    assert reply.token == token
    return reply


def engine_blocked_in_a_test_hook(entered: threading.Event, release: threading.Event) -> None:
    entered.set()
    release.wait(20)


def test_stacks_come_back_while_the_engine_thread_is_blocked(gateway):
    entered, release = threading.Event(), threading.Event()
    engine = ScriptedEngine()
    engine.step_hook = lambda: engine_blocked_in_a_test_hook(entered, release)
    worker, engine, _ = start(gateway, engine, stall_timeout_s=None)
    try:
        gateway.send(Submit("r1", [1, 2, 3], {"max_tokens": 5}, 32))
        assert entered.wait(5)
        reply = ask(gateway, "stacks")
        assert reply.ok, reply.error
        assert reply.result["process"] == "worker"
        assert reply.result["worker_id"] == "worker-test"
        blocked = [t for t in reply.result["threads"]
                   if any(f["function"] == "engine_blocked_in_a_test_hook" for f in t["frames"])]
        assert len(blocked) == 1
        functions = [f["function"] for f in blocked[0]["frames"]]
        # The whole way down: the loop, its step, the hook that blocks, where it waits.
        assert functions.index("WorkerLoop._step") < functions.index(
            "engine_blocked_in_a_test_hook") < functions.index("Event.wait")
        assert any(t["name"].startswith("gateway-link-") for t in reply.result["threads"])
    finally:
        release.set()
    stop(gateway, worker)


def test_bad_arguments_and_a_second_profile_are_refused(gateway):
    worker, engine, _ = start(gateway)
    try:
        bad = ask(gateway, "profile", seconds=10_000)
        assert not bad.ok and bad.code == "bad_args" and "'seconds'" in bad.error
        gateway.send(DebugRequest("first", "profile", {"seconds": 1.0}))
        second = None
        while second is None:  # the second waits for the first to have started
            gateway.send(DebugRequest("second", "profile", {"seconds": 0.05}))
            reply = gateway.recv(DebugReply)
            second = reply if reply.token == "second" and not reply.ok else None
        assert second.code == "busy"
        assert gateway.recv(DebugReply, 5).token in ("first", "second")
    finally:
        stop(gateway, worker)


def test_a_flood_of_debug_requests_gets_busy_replies_not_a_thread_each():
    from zeroserve.worker.debug import MAX_ANSWERING, WorkerDebug

    debug, replies = WorkerDebug("worker-test"), []
    for i in range(MAX_ANSWERING + 3):  # memory diffs wait 0.5 s each: all still running
        debug.handle(DebugRequest(f"t{i}", "memory", {"action": "diff", "seconds": 0.5}),
                     replies.append)
    assert wait_until(lambda: len(replies) == MAX_ANSWERING + 3, 10)
    assert sum(r.code == "busy" for r in replies) >= 3
    assert sum(r.ok for r in replies) == 1  # one diff at a time: the slot


def allocated_in_the_worker_test() -> list[bytes]:
    return [bytes(2048) + bytes([i % 256]) for i in range(1000)]


def test_the_memory_view_of_a_worker(gateway):
    worker, engine, _ = start(gateway)
    kept: list[bytes] = []
    try:
        timer = threading.Thread(target=lambda: wait_until(tracemalloc.is_tracing)
                                 and kept.extend(allocated_in_the_worker_test()))
        timer.start()
        reply = ask(gateway, "memory", action="diff", seconds=0.5, limit=10)
        timer.join()
        assert reply.ok, reply.error
        line = allocated_in_the_worker_test.__code__.co_firstlineno + 1
        assert any(s["site"].endswith(f"test_debug.py:{line}")
                   and s["size_diff_bytes"] > 1000 * 2048 for s in reply.result["sites"])
    finally:
        stop(gateway, worker)


@pytest.fixture(scope="module")
def tiny_engine_config(tiny_hf_dir) -> EngineConfig:
    return EngineConfig(model=str(tiny_hf_dir), device="cpu", dtype="float32",
                        num_kv_blocks=256, block_size=16, max_num_seqs=8)


def test_a_busy_worker_profile_names_the_forward_and_the_torch_trace_its_ops(
        gateway, tiny_engine_config):
    from zeroserve.worker.engine import Engine

    worker, engine, _ = start(gateway, Engine(tiny_engine_config))
    try:
        for i in range(32):  # 8 at a time, a few seconds of work in all
            gateway.send(Submit(f"r{i}", list(range(5, 40)),
                                {"max_tokens": 470, "ignore_eos": True}, 1_000_000))
        assert gateway.tokens(10) is not None  # it is generating
        reply = ask(gateway, "profile", seconds=1.0, hz=200, limit=200)
        assert reply.ok, reply.error
        engine_stacks = [line for line in reply.result["collapsed"].splitlines()
                         if "WorkerLoop._step" in line]
        assert any("LlamaModel.forward (model/llama.py)" in line for line in engine_stacks)
        forward = [row for row in reply.result["top"]
                   if row["function"] == "LlamaModel.forward (model/llama.py)"]
        assert forward and forward[0]["total"] > 0

        traced = ask(gateway, "torch_profile", timeout_s=60, seconds=0.5)
        assert traced.ok, traced.error
        assert traced.result["num_iterations"] > 0
        text = traced.result["trace"]
        if text is None:  # too big for a reply (a loaded machine runs more ops): the file only
            assert traced.result["trace_bytes"] > debug_module._TRACE_ROOM_BYTES
            with open(traced.result["path"]) as f:
                text = f.read()
        trace = json.loads(text)
        names = {event.get("name") for event in trace["traceEvents"]}
        assert any(name and name.startswith("aten::") for name in names)
        with open(traced.result["path"]) as f:  # also saved in the worker's profile folder
            assert json.load(f)["traceEvents"]
    finally:
        stop(gateway, worker)


def test_a_torch_profile_nobody_waits_for_any_more_is_stopped_at_the_next_tick(monkeypatch):
    """The engine thread started the profiler, then stalled past the caller's patience: the
    caller gets `timeout`, and the engine's next tick stops the orphaned profiler."""
    from zeroserve.common.introspection import OneAtATime
    from zeroserve.worker import debug

    monkeypatch.setattr(debug, "TORCH_PROFILE_GRACE_S", 0.3)
    profiler = debug.StepProfiler("worker-test")
    failure: list[Exception] = []

    def ask_for_one() -> None:
        try:
            profiler.run(OneAtATime(), 0.05)
        except debug.TorchProfileError as e:
            failure.append(e)

    caller = threading.Thread(target=ask_for_one)
    caller.start()
    assert wait_until(lambda: profiler._run is not None, 30)
    profiler.tick()  # the engine thread starts it ... and stalls
    assert profiler._active is not None
    caller.join(10)
    assert failure and failure[0].code == "timeout"
    profiler.tick()  # the engine is back
    assert profiler._active is None and profiler._profiler is None


class ExportingProfiler:
    """Stands in for torch's profiler at its stop: writes a trace of `size` bytes."""

    def __init__(self, size: int):
        self.size = size

    def stop(self) -> None:
        pass

    def export_chrome_trace(self, path: str) -> None:
        with open(path, "w") as f:
            f.write('{"traceEvents": []}'.ljust(self.size))


def test_torch_traces_are_bounded_and_their_folders_private(tmp_path, monkeypatch):
    """Traces piled up in the runtime folder without bound, and os.makedirs gave the folders
    it made on the way the umask's mode (755): the runtime folder itself, when a trace was
    the first thing to make it."""
    import os
    import tempfile
    import time

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "fresh" / "tmp"))
    old_umask = os.umask(0o022)
    try:
        profiler = debug_module.StepProfiler("worker-test")
        paths = []
        for _ in range(debug_module.MAX_KEPT_TRACES + 4):
            job = debug_module._TorchRun(0.01)
            job.started_at = time.monotonic()
            profiler._profiler = ExportingProfiler(1000)
            profiler._stop(job)
            assert job.result["trace"] is not None and job.error is None
            paths.append(job.result["path"])
    finally:
        os.umask(old_umask)
    folder = tmp_path / "fresh" / "tmp" / f"zeroserve-{os.getuid()}" / "profiles"
    for made in (folder, folder.parent, folder.parent.parent, folder.parent.parent.parent):
        assert made.stat().st_mode & 0o777 == 0o700, made
    kept = sorted(str(p) for p in folder.iterdir())
    assert kept == sorted(paths[-debug_module.MAX_KEPT_TRACES:])  # the newest
    monkeypatch.setattr(debug_module, "MAX_KEPT_TRACE_BYTES", 2500)
    job = debug_module._TorchRun(0.01)
    job.started_at = time.monotonic()
    profiler._profiler = ExportingProfiler(1000)
    profiler._stop(job)
    assert sorted(str(p) for p in folder.iterdir()) == sorted([*paths[-1:], job.result["path"]])
