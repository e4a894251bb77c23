"""A live look inside the gateway process: its threads' stacks and its asyncio tasks, a
sampling CPU profile, a memory view (common/introspection.py does the process-agnostic part;
the admin routes are gateway/http/debug.py).

The profile and the memory diff run on a thread of their own for their seconds, so the
event loop serves on while they run (and is sampled like every other thread).
"""

from __future__ import annotations

import asyncio
import threading

from zeroserve.common.introspection import (
    MemoryArgs,
    MemoryTracker,
    OneAtATime,
    ProfileArgs,
    frame_list,
    process_info,
    run_profile,
    thread_stacks,
)

MAX_TASKS = 10_000  # a gateway with 1,000 streams has a few thousand tasks
MAX_TASK_FRAMES = 64


def asyncio_tasks(loop: asyncio.AbstractEventLoop | None = None) -> list[dict]:
    """Every task of the running loop (call it on the loop): name, its coroutine, whether
    it is done, and its stack (the awaiting frames, outermost first)."""
    tasks = []
    current = asyncio.current_task()
    for task in list(asyncio.all_tasks(loop))[:MAX_TASKS]:
        frames = []
        for frame in task.get_stack(limit=MAX_TASK_FRAMES):
            # get_stack gives one frame per coroutine in the await chain; its callers are
            # other coroutines' frames, not f_back, so each is taken alone.
            frames.extend(frame_list(frame, limit=1))
        coro = task.get_coro()
        tasks.append({"name": task.get_name(), "done": task.done(),
                      "is_current": task is current,
                      "coro": getattr(coro, "__qualname__", type(coro).__name__),
                      "frames": frames})
    tasks.sort(key=lambda t: t["name"])
    return tasks


class GatewayDebug:
    """The gateway process's profile slot and memory tracker (one of each per process)."""

    def __init__(self) -> None:
        self.slot = OneAtATime()
        self.memory = MemoryTracker()
        self._running: set[threading.Event] = set()  # stop events of running calls

    def stop_all(self) -> None:
        """End running profiles and memory diffs now (the server stops): each answers with
        what it has."""
        for stop in list(self._running):
            stop.set()

    def stacks(self) -> dict:
        """On the event loop: threads and asyncio tasks."""
        return {"process": "gateway", **process_info(), "threads": thread_stacks(),
                "tasks": asyncio_tasks()}

    async def profile(self, args: ProfileArgs) -> dict:
        """Busy if a profile runs already; the event loop goes on while it samples."""
        stop = threading.Event()
        self._running.add(stop)
        try:
            result = await asyncio.to_thread(run_profile, self.slot, args, stop)
        finally:
            stop.set()  # a cancelled call (the client left) ends the sampler too
            self._running.discard(stop)
        return {"process": "gateway", **process_info(), **result}

    async def memory_view(self, args: MemoryArgs) -> dict:
        stop = threading.Event()
        self._running.add(stop)
        try:
            result = await asyncio.to_thread(self.memory.handle, args, self.slot, stop)
        finally:
            stop.set()
            self._running.discard(stop)
        return {"process": "gateway", **process_info(), **result}
