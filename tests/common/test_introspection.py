"""The process-agnostic look inside a process: stacks name where a thread waits, a profile
names the function that burns the CPU, the memory view names the line that allocated."""

from __future__ import annotations

import threading
import time

import pytest

from zeroserve.common.introspection import (
    MAX_PROFILE_SECONDS,
    Busy,
    MemoryArgs,
    MemoryTracker,
    OneAtATime,
    ProfileArgs,
    format_memory,
    format_stacks,
    format_top,
    run_profile,
    thread_stacks,
)


def parked_in_a_test_lock(release: threading.Event) -> None:
    release.wait(10)


def spin_in_a_test_loop(stop: threading.Event) -> None:
    total = 0
    while not stop.is_set():
        total += sum(i * i for i in range(200))


def background(target, name: str):
    event = threading.Event()
    thread = threading.Thread(target=target, args=(event,), name=name, daemon=True)
    thread.start()
    return event, thread


def test_stacks_name_every_thread_and_where_it_waits():
    release, thread = background(parked_in_a_test_lock, "parked-thread")
    try:
        # Until it is parked (after a fixed 50 ms nap, a thread started late on a loaded
        # machine could still be on its way to the wait).
        deadline = time.monotonic() + 30
        while True:
            threads = {t["name"]: t for t in thread_stacks()}
            frames = threads["parked-thread"]["frames"]
            if (frames and frames[-1]["function"] == "Condition.wait"
                    or time.monotonic() > deadline):
                break
            time.sleep(0.01)
        parked = threads["parked-thread"]
        assert parked["daemon"] is True and parked["native_id"] == thread.native_id
        functions = [f["function"] for f in parked["frames"]]
        assert "parked_in_a_test_lock" in functions
        assert functions[-1] == "Condition.wait"  # innermost last, as tracebacks print
        assert threads["MainThread"]["is_current"]
        text = format_stacks({"process": "gateway", "pid": 1, "threads": list(threads.values())})
        assert 'Thread "parked-thread"' in text and "in parked_in_a_test_lock" in text
    finally:
        release.set()
        thread.join()


def test_a_profile_names_the_busy_function_in_both_formats():
    stop, thread = background(spin_in_a_test_loop, "spinner")
    try:
        answer = run_profile(OneAtATime(), ProfileArgs.parse({"seconds": 0.5, "hz": 200}))
    finally:
        stop.set()
        thread.join()
    assert answer["num_samples"] > 10
    spinner = [line for line in answer["collapsed"].splitlines() if line.startswith("spinner;")]
    assert spinner and all("spin_in_a_test_loop (common/test_introspection.py)" in line
                           for line in spinner)
    stack, count = spinner[0].rsplit(" ", 1)
    assert int(count) > 0 and stack.split(";")[0] == "spinner"
    rows = {row["function"]: row for row in answer["top"]}
    row = rows["spin_in_a_test_loop (common/test_introspection.py)"]
    assert row["total"] >= row["self"] and row["total"] > 0
    assert 0 <= answer["overhead_pct"] < 50
    assert "spin_in_a_test_loop" in format_top(answer)
    cpu = {t["name"]: t for t in answer["threads"]}
    assert cpu["spinner"]["cpu_s"] > 0 and cpu["spinner"]["native_id"] == thread.native_id
    assert threading.current_thread().name not in cpu  # the sampler: its cost is overhead


def test_a_profile_of_one_thread_samples_only_it():
    stop, thread = background(spin_in_a_test_loop, "spinner-only")
    try:
        answer = run_profile(OneAtATime(), ProfileArgs.parse({"seconds": 0.2,
                                                              "thread": "spinner-"}))
    finally:
        stop.set()
        thread.join()
    assert {line.split(";")[0] for line in answer["collapsed"].splitlines()} == {"spinner-only"}
    assert [t["name"] for t in answer["threads"]] == ["spinner-only"]


def test_one_profile_at_a_time():
    slot = OneAtATime()
    stop = threading.Event()
    first = threading.Thread(target=run_profile, args=(slot, ProfileArgs(5.0), stop))
    first.start()
    try:
        # Until the first holds the slot (a fixed nap lost the race on a loaded machine,
        # where the thread may not have started yet).
        deadline = time.monotonic() + 30
        while not slot._lock.locked() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(Busy):
            run_profile(slot, ProfileArgs(0.1))
    finally:
        stop.set()
        first.join()
    assert run_profile(slot, ProfileArgs(0.05))["seconds"] < 1  # the slot is free again


@pytest.mark.parametrize("args, message", [
    ({"seconds": MAX_PROFILE_SECONDS + 1}, "'seconds'"),
    ({"seconds": "5"}, "'seconds'"),
    ({"seconds": float("nan")}, "'seconds'"),
    ({"hz": 0}, "'hz'"),
    ({"hz": True}, "'hz'"),
    ({"limit": 10_000}, "'limit'"),
    ({"thread": ""}, "'thread'"),
    ({"thread": 5}, "'thread'"),
])
def test_profile_arguments_are_bounded(args, message):
    with pytest.raises(ValueError, match=message):
        ProfileArgs.parse(args)


def allocate_for_the_memory_test() -> list[bytearray]:
    return [bytearray(4096) for _ in range(500)]


def test_the_memory_view_shows_a_deliberate_allocation_since_the_baseline():
    tracker, slot = MemoryTracker(), OneAtATime()
    with pytest.raises(ValueError, match="not started"):
        tracker.handle(MemoryArgs.parse({"action": "snapshot"}), slot)
    assert tracker.handle(MemoryArgs.parse({"action": "start"}), slot)["is_tracing"]
    try:
        kept = allocate_for_the_memory_test()
        answer = tracker.handle(MemoryArgs.parse({"action": "snapshot", "limit": 5}), slot)
    finally:
        assert not tracker.handle(MemoryArgs.parse({"action": "stop"}), slot)["is_tracing"]
    top = answer["sites"][0]
    assert top["site"].endswith(f"test_introspection.py:{_line_of_the_allocation()}")
    assert top["size_diff_bytes"] >= 500 * 4096 and top["count_diff"] >= 500
    assert "test_introspection.py" in format_memory(answer)
    del kept


def test_a_one_shot_diff_traces_only_while_it_waits():
    import tracemalloc

    tracker, slot = MemoryTracker(), OneAtATime()
    kept = []
    def allocate_once_tracing() -> None:
        deadline = time.monotonic() + 5
        while not tracemalloc.is_tracing() and time.monotonic() < deadline:
            time.sleep(0.005)
        kept.extend(allocate_for_the_memory_test())

    timer = threading.Thread(target=allocate_once_tracing)
    timer.start()
    answer = tracker.handle(MemoryArgs.parse({"action": "diff", "seconds": 0.3}), slot)
    timer.join()
    assert not tracemalloc.is_tracing()
    assert any(s["site"].endswith(f":{_line_of_the_allocation()}") for s in answer["sites"])


def _line_of_the_allocation() -> int:
    return allocate_for_the_memory_test.__code__.co_firstlineno + 1


@pytest.mark.parametrize("action", ["stop", "start"])
def test_a_stop_or_start_while_a_diff_runs_is_busy_and_the_diff_still_answers(action):
    """`debug memory stop` during a running `diff` took the diff's baseline away: the diff
    then failed (a 500). It is refused as busy now, and the diff answers as asked."""
    import tracemalloc

    tracker, slot = MemoryTracker(), OneAtATime()
    stop, answers = threading.Event(), []
    diff = threading.Thread(target=lambda: answers.append(tracker.handle(
        MemoryArgs.parse({"action": "diff", "seconds": 60}), slot, stop)))
    diff.start()
    try:
        deadline = time.monotonic() + 30
        while not tracemalloc.is_tracing() and time.monotonic() < deadline:
            time.sleep(0.005)
        with pytest.raises(Busy, match="memory diff is running"):
            tracker.handle(MemoryArgs.parse({"action": action}), slot)
        assert tracemalloc.is_tracing()
    finally:
        stop.set()
        diff.join()
    assert answers and answers[0]["action"] == "snapshot"
    assert not tracemalloc.is_tracing()  # the diff started tracing; it ended it
    assert tracker.handle(MemoryArgs.parse({"action": "stop"}), slot)["is_tracing"] is False
