"""A live look inside this process (the pprof of zeroserve): thread stacks, a sampling CPU
profiler, a memory view. Process-agnostic: the gateway and the worker each answer their
admin calls with these (gateway/observability/debug_view.py, worker/debug.py).

- Stacks: every thread's Python stack from `sys._current_frames()`, named by
  `threading.enumerate()`. Reading frames needs no cooperation from the thread, so a hung
  engine thread shows exactly where it waits.
- Profile: a thread samples every other thread's stack at `hz` for `seconds`; the result is
  collapsed stacks (`thread;outer;...;inner N`, what flamegraph.pl, speedscope and inferno
  read) and a top-functions table (self and total samples). Its own cost is measured and
  reported (the seconds spent sampling).
- Memory: tracemalloc started on demand; the top allocation sites since a baseline.

Every answer is plain data (dicts, lists, str, int, float) that msgpack and JSON carry, and
bounded: stacks are cut at MAX_STACK_DEPTH frames, a profile at MAX_PROFILE_STACKS distinct
stacks and MAX_COLLAPSED_BYTES of text, a memory view at MAX_MEMORY_SITES sites.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

MAX_PROFILE_SECONDS = 300.0
MAX_MEMORY_SECONDS = 300.0
DEFAULT_HZ = 100
MAX_HZ = 1000
MAX_STACK_DEPTH = 128
MAX_PROFILE_STACKS = 20_000  # distinct stacks kept; more are counted as dropped
MAX_COLLAPSED_BYTES = 4 * 1024 * 1024
MAX_TOP_FUNCTIONS = 200
DEFAULT_TOP_FUNCTIONS = 40
MAX_MEMORY_SITES = 200
DEFAULT_MEMORY_SITES = 25
MAX_TRACEMALLOC_FRAMES = 64
MEMORY_ACTIONS = ("start", "snapshot", "stop", "diff")


class Busy(RuntimeError):
    """Another profile (or timed memory view) is running in this process: one at a time."""


# --- arguments (checked alike by the gateway's HTTP layer and the worker) --------------------

def number_arg(args: dict, name: str, default: float, lo: float, hi: float) -> float:
    """args[name] (or the default) as a finite number in [lo, hi]; ValueError naming it."""
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and lo <= value <= hi):
        raise ValueError(f"'{name}' must be a number in [{lo:g}, {hi:g}]")
    return float(value)


def integer_arg(args: dict, name: str, default: int, lo: int, hi: int) -> int:
    value = args.get(name, default)
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"'{name}' must be an integer in [{lo}, {hi}]")
    return value


@dataclass(frozen=True)
class ProfileArgs:
    seconds: float
    hz: int = DEFAULT_HZ
    limit: int = DEFAULT_TOP_FUNCTIONS  # rows of the top-functions table
    thread: str | None = None  # sample only threads whose name starts with this

    @classmethod
    def parse(cls, args: dict) -> ProfileArgs:
        """ValueError naming the argument for anything out of range."""
        thread = args.get("thread")
        if thread is not None and not (isinstance(thread, str) and 0 < len(thread) <= 128):
            raise ValueError("'thread' must be the start of a thread's name (1 to 128 "
                             "characters)")
        return cls(number_arg(args, "seconds", 5.0, 0.01, MAX_PROFILE_SECONDS),
                   integer_arg(args, "hz", DEFAULT_HZ, 1, MAX_HZ),
                   integer_arg(args, "limit", DEFAULT_TOP_FUNCTIONS, 1, MAX_TOP_FUNCTIONS),
                   thread)

    def to_dict(self) -> dict:
        args = {"seconds": self.seconds, "hz": self.hz, "limit": self.limit}
        return args if self.thread is None else {**args, "thread": self.thread}


@dataclass(frozen=True)
class MemoryArgs:
    action: str  # one of MEMORY_ACTIONS
    seconds: float = 5.0  # "diff": how long to wait between the baseline and the snapshot
    limit: int = DEFAULT_MEMORY_SITES
    frames: int = 1  # traceback depth tracemalloc keeps per allocation (and groups by)

    @classmethod
    def parse(cls, args: dict) -> MemoryArgs:
        action = args.get("action", "diff")
        if action not in MEMORY_ACTIONS:
            raise ValueError(f"'action' must be one of {', '.join(MEMORY_ACTIONS)}")
        return cls(action, number_arg(args, "seconds", 5.0, 0.0, MAX_MEMORY_SECONDS),
                   integer_arg(args, "limit", DEFAULT_MEMORY_SITES, 1, MAX_MEMORY_SITES),
                   integer_arg(args, "frames", 1, 1, MAX_TRACEMALLOC_FRAMES))

    def to_dict(self) -> dict:
        return {"action": self.action, "seconds": self.seconds, "limit": self.limit,
                "frames": self.frames}


# --- stacks -----------------------------------------------------------------------------------

def frame_list(frame: Any, limit: int = MAX_STACK_DEPTH) -> list[dict]:
    """Outermost first (as tracebacks print), at most `limit` innermost frames."""
    frames = []
    while frame is not None and len(frames) < limit:
        code = frame.f_code
        frames.append({"file": code.co_filename, "line": frame.f_lineno,
                       "function": code.co_qualname})
        frame = frame.f_back
    frames.reverse()
    return frames


def thread_stacks() -> list[dict]:
    """Every thread's Python stack now: [{name, ident, native_id, daemon, frames}], the
    calling thread marked `is_current`."""
    threads = {t.ident: t for t in threading.enumerate()}
    current = threading.get_ident()
    result = []
    for ident, frame in sys._current_frames().items():
        thread = threads.get(ident)
        result.append({
            "name": thread.name if thread is not None else f"<unnamed {ident}>",
            "ident": ident,
            "native_id": getattr(thread, "native_id", None),
            "daemon": thread.daemon if thread is not None else None,
            "is_current": ident == current,
            "frames": frame_list(frame),
        })
    result.sort(key=lambda t: (t["name"] != "MainThread", t["name"]))
    return result


def process_info() -> dict:
    return {"pid": os.getpid(), "python": sys.version.split()[0],
            "num_threads": threading.active_count()}


def format_frames(frames: list[dict], indent: str = "  ") -> list[str]:
    return [f'{indent}File "{f["file"]}", line {f["line"]}, in {f["function"]}'
            for f in frames]


def format_stacks(answer: dict) -> str:
    """A stacks answer (threads, and asyncio tasks where there are some) as text, in the
    shape of a Python traceback (innermost call last)."""
    lines = []
    who = answer.get("worker_id") or answer.get("process", "process")
    lines.append(f"# {who} (pid {answer.get('pid')}): {len(answer.get('threads', []))} "
                 f"threads, {len(answer.get('tasks', []))} asyncio tasks")
    for thread in answer.get("threads", []):
        marks = [m for m, on in (("daemon", thread.get("daemon")),
                                 ("this call", thread.get("is_current"))) if on]
        suffix = f" ({', '.join(marks)})" if marks else ""
        lines.append("")
        lines.append(f'Thread "{thread["name"]}" id={thread.get("native_id")}{suffix}, '
                     "most recent call last:")
        lines.extend(format_frames(thread["frames"]))
    for task in answer.get("tasks", []):
        lines.append("")
        state = "done" if task.get("done") else "pending"
        lines.append(f'Task "{task["name"]}" ({state}) {task.get("coro", "")}:')
        lines.extend(format_frames(task["frames"]) or ["  (no frames)"])
    return "\n".join(lines) + "\n"


# --- the sampling profiler ---------------------------------------------------------------------

class OneAtATime:
    """The process's profile slot: a second profile while one runs is refused (Busy)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> OneAtATime:
        if not self._lock.acquire(blocking=False):
            raise Busy("a profile is already running in this process; wait for it to end")
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


class SamplingProfiler:
    """Samples every other thread's Python stack `hz` times a second.

    A sample is the thread's name then its frames, outermost first, each as
    `qualname (file.py)`; identical samples are counted together. Runs in the calling
    thread (`run`), which is not sampled; `stop_event` ends it early.
    """

    def __init__(self, hz: int = DEFAULT_HZ, thread: str | None = None):
        self.interval_s = 1.0 / hz
        self.thread = thread  # only threads whose name starts with it (None: all)
        self._labels: dict[Any, str] = {}  # code object -> label (interned once)

    def run(self, seconds: float, stop_event: threading.Event | None = None) -> Profile:
        counts: Counter[tuple[str, ...]] = Counter()
        me = threading.get_ident()
        num_samples = num_dropped = 0
        sampling_s = 0.0
        names: dict[int, str] = {}
        cpu_at_start = _thread_cpu_times()
        started = time.perf_counter()
        deadline = started + seconds
        next_at = started
        while True:
            now = time.perf_counter()
            if now >= deadline or (stop_event is not None and stop_event.is_set()):
                break
            if now < next_at:
                time.sleep(next_at - now)
                continue
            next_at += self.interval_s
            if next_at < now:  # fell behind (a long GIL hold): skip, do not burst
                next_at = now + self.interval_s
            frames = sys._current_frames()
            if len(names) != threading.active_count():
                names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in frames.items():
                name = names.get(ident, f"thread-{ident}")
                if ident == me or (self.thread is not None and not name.startswith(self.thread)):
                    continue
                stack = self._stack(name, frame)
                if stack in counts or len(counts) < MAX_PROFILE_STACKS:
                    counts[stack] += 1
                else:
                    num_dropped += 1
            del frames
            num_samples += 1
            sampling_s += time.perf_counter() - now
        wall_s = time.perf_counter() - started
        cpu_at_end = _thread_cpu_times()
        cpu_at_end.pop(me, None)  # the sampler's own cost is `sampling_s`
        return Profile(counts, num_samples, wall_s, sampling_s, num_dropped,
                       _cpu_by_thread(cpu_at_start, cpu_at_end, wall_s, self.thread))

    def _stack(self, thread_name: str, frame: Any) -> tuple[str, ...]:
        labels = []
        depth = 0
        while frame is not None and depth < MAX_STACK_DEPTH:
            code = frame.f_code
            label = self._labels.get(code)
            if label is None:
                label = self._labels[code] = _label(code)
            labels.append(label)
            frame = frame.f_back
            depth += 1
        labels.append(thread_name.replace(";", ":").replace(" ", "_"))
        labels.reverse()
        return tuple(labels)


def _thread_cpu_times() -> dict[int, tuple[str, int | None, float]]:
    """ident -> (name, native id, CPU seconds so far) of every live thread, where the
    platform has per-thread CPU clocks (Linux, macOS); {} elsewhere."""
    if not hasattr(time, "pthread_getcpuclockid"):
        return {}
    times = {}
    for thread in threading.enumerate():
        try:
            cpu_s = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, TypeError, OverflowError):  # it ended meanwhile
            continue
        times[thread.ident] = (thread.name, thread.native_id, cpu_s)
    return times


def _cpu_by_thread(before: dict, after: dict, wall_s: float,
                   prefix: str | None) -> list[dict]:
    """Each thread's CPU time over the profile (a thread started meanwhile: since its start),
    busiest first: which threads burn the CPU, beside where."""
    rows = []
    for ident, (name, native_id, cpu_s) in after.items():
        if prefix is not None and not name.startswith(prefix):
            continue
        used = cpu_s - before[ident][2] if ident in before else cpu_s
        rows.append({"name": name, "native_id": native_id, "cpu_s": round(used, 4),
                     "cpu_pct": round(100 * used / max(wall_s, 1e-9), 2)})
    rows.sort(key=lambda r: -r["cpu_s"])
    return rows


def _label(code: Any) -> str:
    """`qualname (dir/file.py)`: what a flame graph shows; `;` would split a frame."""
    path = code.co_filename
    short = "/".join(path.replace("\\", "/").split("/")[-2:])
    return f"{code.co_qualname} ({short})".replace(";", ":")


@dataclass
class Profile:
    counts: Counter  # stack (thread name, outermost, ..., innermost) -> samples
    num_samples: int  # sampling rounds (each takes every thread once)
    wall_s: float
    sampling_s: float  # time the sampler itself spent taking samples
    num_dropped: int  # thread samples not kept (MAX_PROFILE_STACKS distinct stacks)
    threads: list[dict] = field(default_factory=list)  # CPU time per thread (_cpu_by_thread)

    def collapsed(self) -> tuple[str, bool]:
        """`frame;frame;frame N` lines, most samples first, and whether the text was cut at
        MAX_COLLAPSED_BYTES (the rarest stacks go first)."""
        lines, size = [], 0
        for stack, n in self.counts.most_common():
            line = f"{';'.join(stack)} {n}"
            size += len(line) + 1
            if size > MAX_COLLAPSED_BYTES:
                return "\n".join(lines) + "\n", True
            lines.append(line)
        return ("\n".join(lines) + "\n") if lines else "", False

    def top(self, limit: int = DEFAULT_TOP_FUNCTIONS) -> list[dict]:
        """Functions by self samples (the innermost frame), with total samples (anywhere
        on the stack, once per sample) beside them, as pprof's `top`."""
        self_counts: Counter[str] = Counter()
        total_counts: Counter[str] = Counter()
        num = sum(self.counts.values()) or 1
        for stack, n in self.counts.items():
            frames = stack[1:]  # without the thread name
            if not frames:
                continue
            self_counts[frames[-1]] += n
            for label in set(frames):
                total_counts[label] += n
        rows = sorted(total_counts, key=lambda f: (-self_counts[f], -total_counts[f], f))
        return [{"function": f, "self": self_counts[f], "total": total_counts[f],
                 "self_pct": round(100 * self_counts[f] / num, 2),
                 "total_pct": round(100 * total_counts[f] / num, 2)} for f in rows[:limit]]

    def to_dict(self, args: ProfileArgs) -> dict:
        collapsed, is_truncated = self.collapsed()
        return {
            "seconds": round(self.wall_s, 3), "hz": args.hz, "num_samples": self.num_samples,
            "num_thread_samples": sum(self.counts.values()),
            "num_dropped": self.num_dropped,
            # The sampler's own cost: the share of one core it used while it ran.
            "sampling_s": round(self.sampling_s, 4),
            "overhead_pct": round(100 * self.sampling_s / max(self.wall_s, 1e-9), 3),
            "collapsed": collapsed, "is_truncated": is_truncated,
            "top": self.top(args.limit), "threads": self.threads,
        }


def run_profile(slot: OneAtATime, args: ProfileArgs,
                stop_event: threading.Event | None = None) -> dict:
    """One profile in the calling thread (Busy if one runs already): its answer."""
    with slot:
        return SamplingProfiler(args.hz, args.thread).run(args.seconds,
                                                          stop_event).to_dict(args)


def format_top(answer: dict) -> str:
    """A profile's top-functions table as text."""
    lines = [f"# {answer.get('worker_id') or answer.get('process', 'process')}: "
             f"{answer['num_samples']} samples in {answer['seconds']}s at {answer['hz']} Hz "
             f"(sampler overhead {answer['overhead_pct']}% of a core)"]
    busy = [t for t in answer.get("threads", []) if t["cpu_s"] > 0][:8]
    if busy:
        lines.append("# CPU by thread: " + ", ".join(f"{t['name']} {t['cpu_pct']:.1f}%"
                                                     for t in busy))
    lines.append(f"{'self':>8} {'self%':>7} {'total':>8} {'total%':>7}  function")
    for row in answer["top"]:
        lines.append(f"{row['self']:>8} {row['self_pct']:>6.2f}% {row['total']:>8} "
                     f"{row['total_pct']:>6.2f}%  {row['function']}")
    return "\n".join(lines) + "\n"


# --- memory -------------------------------------------------------------------------------------

class MemoryTracker:
    """tracemalloc on demand: `start` takes a baseline, `snapshot` shows the top sites that
    grew since, `stop` ends tracing (and its overhead). `diff` is all three in one call
    (start, wait, snapshot, stop) unless tracing was on already (then it keeps it on)."""

    def __init__(self) -> None:
        self._baseline: tracemalloc.Snapshot | None = None
        self._lock = threading.Lock()
        self._frames = 1
        self._diff_ends_at: float | None = None  # monotonic; set while a diff waits

    def handle(self, args: MemoryArgs, slot: OneAtATime,
               stop_event: threading.Event | None = None) -> dict:
        if args.action in ("start", "stop"):
            with self._lock:
                # A running diff owns the baseline and ends tracing (or not) itself: a stop
                # under it left it nothing to compare with (a 500), a start replaced its
                # baseline.
                if self._diff_ends_at is not None:
                    left_s = max(0.0, self._diff_ends_at - time.monotonic())
                    raise Busy(f"a memory diff is running (about {left_s:.0f} s left); "
                               f"'{args.action}' after it ends")
                return self._start(args.frames) if args.action == "start" else self._stop()
        if args.action == "snapshot":
            with self._lock:
                if self._baseline is None:
                    raise ValueError("memory tracing is not started (action 'start' first)")
                return self._snapshot(args.limit)
        with slot:  # "diff": holds the process's profile slot while it waits
            with self._lock:
                was_tracing = self._baseline is not None
                if not was_tracing:
                    self._start(args.frames)
                self._diff_ends_at = time.monotonic() + args.seconds
            try:
                if stop_event is None:
                    time.sleep(args.seconds)
                else:
                    stop_event.wait(args.seconds)
                with self._lock:
                    answer = self._snapshot(args.limit)
                    if not was_tracing:
                        self._stop()
            finally:
                self._diff_ends_at = None
            return answer

    def _start(self, frames: int) -> dict:
        if not tracemalloc.is_tracing():
            tracemalloc.start(frames)
        self._frames = tracemalloc.get_traceback_limit()
        self._baseline = self._take()
        return {"action": "start", "is_tracing": True, "frames": self._frames}

    def _stop(self) -> dict:
        self._baseline = None
        tracemalloc.stop()
        return {"action": "stop", "is_tracing": False}

    def _take(self) -> tracemalloc.Snapshot:
        return tracemalloc.take_snapshot().filter_traces((
            tracemalloc.Filter(False, tracemalloc.__file__),
            tracemalloc.Filter(False, __file__),
            tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
            tracemalloc.Filter(False, "<unknown>"),
        ))

    def _snapshot(self, limit: int) -> dict:
        assert self._baseline is not None
        key = "traceback" if self._frames > 1 else "lineno"
        stats = self._take().compare_to(self._baseline, key)
        current, peak = tracemalloc.get_traced_memory()
        sites = []
        for stat in stats[:limit]:
            frames = [{"file": f.filename, "line": f.lineno} for f in stat.traceback]
            sites.append({"site": f"{frames[-1]['file']}:{frames[-1]['line']}" if frames
                          else "?", "size_diff_bytes": stat.size_diff,
                          "count_diff": stat.count_diff, "size_bytes": stat.size,
                          "count": stat.count, "traceback": frames})
        return {"action": "snapshot", "is_tracing": True, "traced_bytes": current,
                "peak_traced_bytes": peak, "sites": sites}


def format_memory(answer: dict) -> str:
    who = answer.get("worker_id") or answer.get("process", "process")
    if "sites" not in answer:
        state = "on" if answer.get("is_tracing") else "off"
        return f"# {who}: memory tracing {state} ({answer['action']})\n"
    lines = [f"# {who}: traced {answer['traced_bytes'] / 2**20:.1f} MiB now, peak "
             f"{answer['peak_traced_bytes'] / 2**20:.1f} MiB; top sites since the baseline",
             f"{'grew':>12} {'blocks':>9} {'now':>12}  site"]
    for site in answer["sites"]:
        lines.append(f"{_bytes(site['size_diff_bytes']):>12} {site['count_diff']:>+9} "
                     f"{_bytes(site['size_bytes'], signed=False):>12}  {site['site']}")
    return "\n".join(lines) + "\n"


def _bytes(n: float, signed: bool = True) -> str:
    sign = "-" if n < 0 else "+" if signed else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    return f"{sign}{n:.1f} GiB"
