"""A live look inside the worker, answered off the engine thread (DEBUG_REQUEST/DEBUG_REPLY).

The link thread (worker/link.py) hands each DEBUG_REQUEST to `WorkerDebug.handle`, which
answers it on a short-lived thread of its own: stacks at once, a CPU profile or a memory
diff after its seconds. So the answer comes while the engine thread is hung (the case that
matters most), and a profile of N seconds never delays a heartbeat.

The torch profiler is the one part that needs the engine thread: it records the ops of the
thread that starts it, so `StepProfiler` only asks, and the engine loop (process.py) calls
`tick()` once per iteration to start it, and to stop it and write the chrome trace once its
seconds are up (vLLM's start/stop profile). A hung engine thread never starts it: the reply
then says so after the request's seconds plus a grace.

One profile at a time per process (the CPU profile, a timed memory diff and the torch
profile share the slot): a second is answered `busy` (the gateway's 409).

Chrome traces are saved in the runtime folder's `profiles/` (mode 700, every folder made
on the way too); after each, only the newest MAX_KEPT_TRACES, MAX_KEPT_TRACE_BYTES in all,
stay (every worker of this user shares the folder).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack

from zeroserve.common.introspection import (
    MAX_PROFILE_SECONDS,
    Busy,
    MemoryArgs,
    MemoryTracker,
    OneAtATime,
    ProfileArgs,
    number_arg,
    process_info,
    run_profile,
    thread_stacks,
)
from zeroserve.common.protocol import MAX_DEBUG_REPLY_BYTES, DebugReply, DebugRequest
from zeroserve.common.runtime_dir import (
    is_private_dir,
    make_private_dirs,
    prune_oldest,
    runtime_dir,
)

log = logging.getLogger("zeroserve.worker")

# Beyond its seconds, how long a torch profile may wait for the engine thread to start and
# stop it (a step, the profiler's first start, the trace's export) before the reply says the
# engine did not answer.
TORCH_PROFILE_GRACE_S = 60.0
_TRACE_ROOM_BYTES = MAX_DEBUG_REPLY_BYTES - 64 * 1024  # the rest of a reply's fields
MAX_ANSWERING = 8  # debug requests answered at once; more are refused (busy), not queued
MAX_KEPT_TRACES = 8  # chrome traces kept in the profiles folder (all workers together)
MAX_KEPT_TRACE_BYTES = 256 * 1024 * 1024
TRACE_SUFFIX = ".trace.json"


class WorkerDebug:
    """Answers DEBUG_REQUESTs for one worker process (shared by all its gateway links)."""

    def __init__(self, worker_id: str, wake: Callable[[], None] | None = None):
        self.worker_id = worker_id
        self.slot = OneAtATime()
        self.memory = MemoryTracker()
        self.torch = StepProfiler(worker_id, wake)
        self._answering = threading.BoundedSemaphore(MAX_ANSWERING)

    def handle(self, msg: DebugRequest, reply: Callable[[DebugReply], None]) -> None:
        """Answer on a thread of its own; `reply` sends from that thread. A flood of
        requests gets `busy` replies, never a thread each."""
        if not self._answering.acquire(blocking=False):
            reply(DebugReply(msg.token, False, code="busy",
                             error=f"{MAX_ANSWERING} debug requests are being answered"))
            return
        threading.Thread(target=self._answer, args=(msg, reply), daemon=True,
                         name=f"debug-{msg.kind}").start()

    def _answer(self, msg: DebugRequest, reply: Callable[[DebugReply], None]) -> None:
        try:
            self._answer_one(msg, reply)
        finally:
            self._answering.release()

    def _answer_one(self, msg: DebugRequest, reply: Callable[[DebugReply], None]) -> None:
        try:
            result = self.answer(msg.kind, msg.args)
        except Busy as e:
            answer = DebugReply(msg.token, False, error=str(e), code="busy")
        except ValueError as e:
            answer = DebugReply(msg.token, False, error=str(e)[:4096], code="bad_args")
        except TorchProfileError as e:
            answer = DebugReply(msg.token, False, error=str(e)[:4096], code=e.code)
        except Exception as e:  # the process goes on serving, whatever went wrong here
            log.exception("a debug request failed", extra={"worker_id": self.worker_id})
            answer = DebugReply(msg.token, False, error=f"{type(e).__name__}: {e}"[:4096],
                                code="failed")
        else:
            answer = DebugReply(msg.token, True, result)
            if len(msgpack.packb(result, use_bin_type=True)) > MAX_DEBUG_REPLY_BYTES:
                answer = DebugReply(msg.token, False, code="failed",
                                    error="the answer is larger than a reply may be")
        reply(answer)

    def answer(self, kind: str, args: dict) -> dict:
        """The answer to one request (in the calling thread), with who answered."""
        if kind == "stacks":
            result = {"threads": thread_stacks()}
        elif kind == "profile":
            result = run_profile(self.slot, ProfileArgs.parse(args))
        elif kind == "memory":
            result = self.memory.handle(MemoryArgs.parse(args), self.slot)
        elif kind == "torch_profile":
            result = self.torch.run(self.slot, number_arg(args, "seconds", 5.0, 0.01,
                                                       MAX_PROFILE_SECONDS))
        else:
            raise ValueError(f"unknown kind {kind!r}")
        return {"process": "worker", "worker_id": self.worker_id, **process_info(), **result}


class TorchProfileError(RuntimeError):
    def __init__(self, message: str, code: str = "failed"):
        super().__init__(message)
        self.code = code


@dataclass
class _TorchRun:
    seconds: float
    done: threading.Event = field(default_factory=threading.Event)
    started_at: float | None = None  # monotonic, set by the engine thread
    num_ticks: int = 0  # engine loop ticks between the start's and the stop's
    result: dict | None = None
    error: str | None = None


class StepProfiler:
    """The torch profiler around the engine loop's iterations, started and stopped by the
    engine thread (`tick`); asked for by a debug thread (`run`)."""

    def __init__(self, worker_id: str, wake: Callable[[], None] | None = None):
        self.worker_id = worker_id
        self.wake = wake or (lambda: None)  # ends the engine loop's wait for messages
        self._run: _TorchRun | None = None  # set by run(), cleared by it (engine reads it)
        self._profiler = None
        self._active: _TorchRun | None = None  # the job whose profiler runs (engine thread)

    def run(self, slot: OneAtATime, seconds: float) -> dict:
        with slot:
            import torch.profiler  # noqa: F401  (here, not on the engine thread: seconds, once)

            job = self._run = _TorchRun(seconds)
            self.wake()
            try:
                if not job.done.wait(seconds + TORCH_PROFILE_GRACE_S):
                    raise TorchProfileError(
                        "the engine thread did not run the torch profiler (is it hung? ask "
                        "for its stacks)", code="timeout")
            finally:
                self._run = None  # a profiler still running is discarded at the next tick
            if job.error is not None:
                raise TorchProfileError(job.error)
            assert job.result is not None
            return job.result

    def tick(self) -> None:
        """Once per engine loop iteration, on the engine thread: start a requested profile,
        or stop one whose seconds are up. Costs two attribute reads when none is asked for."""
        job = self._run
        if self._active is not None and self._active is not job:
            self._discard()  # its caller gave up waiting: nobody reads this trace
        if job is None or job.done.is_set():
            return
        try:
            if job.started_at is None:
                self._start(job)
            elif time.monotonic() - job.started_at >= job.seconds:
                self._stop(job)
            else:
                job.num_ticks += 1
        except Exception as e:
            log.exception("torch profile failed", extra={"worker_id": self.worker_id})
            self._profiler = self._active = None
            job.error = f"{type(e).__name__}: {e}"
            job.done.set()

    def _discard(self) -> None:
        profiler, self._profiler, self._active = self._profiler, None, None
        try:
            profiler.stop()
        except Exception:  # it was failing anyway; the engine goes on
            log.exception("stopping an abandoned torch profile failed",
                          extra={"worker_id": self.worker_id})

    def _start(self, job: _TorchRun) -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._active = job
        self._profiler.start()
        job.started_at = time.monotonic()

    def _stop(self, job: _TorchRun) -> None:
        profiler, self._profiler, self._active = self._profiler, None, None
        profiler.stop()
        folder = make_private_dirs(runtime_dir() / "profiles")
        if not is_private_dir(folder) or not is_private_dir(folder.parent):
            raise OSError(f"{folder} (and its parent) must be owned by uid {os.getuid()} and "
                          "closed to others (mode 700) to hold a trace")
        path = str(folder / f"{self.worker_id}-{os.getpid()}-{time.time_ns()}{TRACE_SUFFIX}")
        profiler.export_chrome_trace(path)
        size = os.path.getsize(path)
        prune_oldest(folder, TRACE_SUFFIX, MAX_KEPT_TRACES, MAX_KEPT_TRACE_BYTES)
        trace = None
        if size <= _TRACE_ROOM_BYTES:
            with open(path, encoding="utf-8") as f:
                trace = f.read()
            json.loads(trace)  # what we send must be JSON (a failure is this job's error)
        job.result = {"seconds": round(time.monotonic() - job.started_at, 3),
                      # The iterations that ran under the profiler: those ending in the
                      # ticks between, and the one ending in the stop's tick.
                      "num_iterations": job.num_ticks + 1, "path": path,
                      "trace_bytes": size,
                      "trace": trace}
        job.done.set()
