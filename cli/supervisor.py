"""`zeroserve serve`'s process supervisor: the gateway and N local workers as child processes.

The gateway is a child too (not this process) so that shutdown can be ordered — workers
drain through a gateway that is still serving — and so that a crashed gateway is restarted
like anything else (its workers notice the silence and say HELLO to the new one).

- A child that exits after running for `stable_after_s` (a crash or an operator's kill of a
  child that was serving) is restarted at once: while it is down, its share of the load
  waits on the others. Quick exits in a row wait a backoff that doubles per failure, from
  `initial_backoff_s`, so a crash loop does not spin. A worker's death never touches the
  gateway or the other workers; an operator can `kill <pid>` one worker to restart just
  that one.
- A child whose very first start exits with an error code soon (bad flag, missing model,
  port in use) is a configuration error: everything stops and `serve` exits 1 instead of
  looping. That rule holds only until the child has been ready once: after that every exit
  is restarted (a worker that served and then crashed is a crash, not a bad flag). Death by
  a signal (an operator's kill, the OOM killer) is always restarted.
- A child that is alive but useless (a SIGSTOPped or hung worker: the gateway marked it
  lost, or stalled) would never exit by itself. An `unresponsive` probe, run on a thread of
  its own every `watch_interval_s` for the supervisor's whole life, names such children
  (`serve` asks the gateway's /health, cli/children.py); one named with the same pid
  for `unresponsive_timeout_s` in a row is killed (SIGKILL) and so restarted.
- Readiness comes from a `readiness` probe, if one is given: a callable, run on a thread of
  its own every `probe_interval_s` while some child has never been ready, that gets the
  pids of the running children and returns the names of those that are ready now. `serve`
  asks the gateway (cli/children.py). Without a probe no child is ever known to be ready
  and only the startup window bounds the rule.
- SIGTERM/SIGINT/SIGHUP: the workers get SIGTERM first and drain (they finish in-flight
  requests through the still-running gateway), then the gateway gets SIGTERM. Another
  signal, a second or more after the first, kills everything at once.
- Children run in their own sessions (a terminal's Ctrl-C reaches only the supervisor,
  which stops them in order) and die with it: each calls `die_with_parent()` first thing,
  before any work that may take long (a Hub download), which sets PR_SET_PDEATHSIG, so even
  a SIGKILLed supervisor leaves no orphans.
- A child's exit is told at once to an `exit_notice`, if one is given: a callable, run on
  a thread of its own (the main loop never waits on it), that gets the child's name, its
  pid and its exit code (Popen's: -N for death by signal N). `serve` tells the gateway
  (cli/children.py), which takes that worker process out and moves its streams on the
  moment it is reaped, not seconds later when its heartbeats lapse: the exit itself is the
  one sign of death that a busy machine cannot fake. Exits while stopping are not told.
- Every exited child is reaped, not only ours: `serve` as a container's PID 1 inherits the
  orphans of the whole container and must not let them pile up as zombies.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("zeroserve.supervisor")

PARENT_PID_ENV = "ZEROSERVE_SUPERVISOR_PID"
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    # A child that ran this long restarts at once, and its next quick failure waits the
    # initial backoff again.
    stable_after_s: float = 10.0
    # A first start that exits with an error code (not a signal) this soon is a configuration
    # error: stop everything rather than loop.
    startup_window_s: float = 60.0
    probe_interval_s: float = 0.5  # how often the readiness probe runs until all were ready
    # A child the `unresponsive` probe names (the gateway sees it lost or stalled) for this
    # long in a row is killed (SIGKILL) and so restarted. None: never.
    unresponsive_timeout_s: float | None = 30.0
    watch_interval_s: float = 1.0  # how often the unresponsive probe runs


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: tuple[str, ...]
    stop_timeout_s: float  # after SIGTERM, how long it may take before SIGKILL
    stop_phase: int = 0  # lower phases stop first (workers 0, gateway 1)
    env: dict[str, str] | None = None  # extra variables on top of ours


@dataclass
class _Child:
    spec: ChildSpec
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    num_starts: int = 0
    backoff_s: float = 0.0
    restart_at: float | None = None  # when a restart is due
    # Set (by the probe thread) once any incarnation of this child was seen ready; never
    # cleared. A plain bool written by one thread and read by another: no lock needed.
    has_been_ready: bool = False
    # Set by the watch thread: the pid to kill (unresponsive too long); the main loop kills
    # it if it is still this child's process, and clears it.
    kill_pid: int | None = None


# Pids of the running children by name -> names of those that are ready now.
ReadinessProbe = Callable[[dict[str, int]], set[str]]
# Pids of the running children by name -> names of those that are unresponsive now (lost or
# stalled in the gateway's view), or None when that cannot be known now.
UnresponsiveProbe = Callable[[dict[str, int]], set[str] | None]
# A child's process exited: its name, its pid, its exit code (-N: killed by signal N).
ExitNotice = Callable[[str, int, int], None]


class Supervisor:
    def __init__(self, children: list[ChildSpec], policy: RestartPolicy | None = None,
                 readiness: ReadinessProbe | None = None,
                 unresponsive: UnresponsiveProbe | None = None,
                 exit_notice: ExitNotice | None = None):
        self.policy = policy or RestartPolicy()
        self.readiness = readiness
        self.unresponsive = unresponsive
        self.exit_notice = exit_notice
        # (name, pid, exit code) for the exit-notice thread; None ends it.
        self._exits: queue.SimpleQueue[tuple[str, int, int] | None] = queue.SimpleQueue()
        self.children = [_Child(spec, backoff_s=self.policy.initial_backoff_s)
                         for spec in children]
        self.exit_code = 0
        self._num_signals = 0
        self._first_signal_at = 0.0
        self._stopping = threading.Event()

    def run(self) -> int:
        """Start everything, keep it running until a signal, stop in order. Main thread only."""
        # Signal handlers wake the main loop through a pipe, never a lock: a handler runs in
        # the main thread between two bytecodes, so one that took threading.Event's lock
        # while the main loop held it (inside Event.wait or clear) would wait on itself
        # forever (seen as a `serve` that ignored SIGTERM).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        previous = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, self._on_child_exit)
        try:
            for child in self.children:
                self._start(child)
            if self.readiness is not None:
                threading.Thread(target=self._probe_loop, daemon=True, name="readiness").start()
            if self.unresponsive is not None and self.policy.unresponsive_timeout_s is not None:
                threading.Thread(target=self._watch_loop, daemon=True, name="watch").start()
            if self.exit_notice is not None:
                threading.Thread(target=self._notice_loop, daemon=True,
                                 name="exit-notice").start()
            while not self._num_signals and not self._is_fatal():
                self._wait_for_wake(self._seconds_to_next_restart())
                self._reap_and_restart()
            self.stop()
        finally:
            self._stopping.set()
            self._exits.put(None)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(self._wake_r)
            os.close(self._wake_w)
        return self.exit_code

    def _wake(self) -> None:
        """From a signal handler: end the main loop's wait (no lock taken)."""
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):  # full: a wake is pending anyway; closed: done
            pass

    def _wait_for_wake(self, timeout_s: float) -> None:
        select.select([self._wake_r], [], [], timeout_s)  # a handler's byte ends it early
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _on_signal(self, signum: int, frame: Any) -> None:
        # A repeat within a second is one event delivered twice (a process group, a wrapper
        # forwarding it), not an operator insisting.
        now = time.monotonic()
        if self._num_signals == 0 or now - self._first_signal_at >= 1.0:
            self._num_signals += 1
        if self._num_signals == 1:
            self._first_signal_at = now
        self._wake()
        if self._num_signals > 1:  # impatient operator: no more waiting
            for child in self.children:
                _send(child, signal.SIGKILL)

    def _on_child_exit(self, signum: int, frame: Any) -> None:
        self._wake()  # reap at once instead of at the next tick

    def _seconds_to_next_restart(self) -> float:
        due = [c.restart_at for c in self.children if c.restart_at is not None]
        # The 1 s tick only guards against a lost SIGCHLD; exits normally wake us at once.
        return max(0.0, min([1.0, *(t - time.monotonic() for t in due)]))

    def _is_fatal(self) -> bool:
        return self.exit_code != 0

    def _reap_and_restart(self) -> None:
        self._reap()
        now = time.monotonic()
        for child in self.children:
            process = child.process
            if child.kill_pid is not None:
                if process is not None and process.pid == child.kill_pid:
                    _send(child, signal.SIGKILL)  # its exit is reaped below or on SIGCHLD
                child.kill_pid = None
            if process is not None and process.poll() is not None:
                self._on_exit(child, process.returncode, now)
                if self.exit_notice is not None and not self._is_fatal():
                    self._exits.put((child.spec.name, process.pid, process.returncode))
            if child.restart_at is not None and now >= child.restart_at:
                self._start(child)

    def _reap(self) -> None:
        """Collect every child that exited: ours (their Popen learns the exit code, as its
        own poll() would) and orphans. As a container's PID 1, `serve` inherits every process
        whose parent died (a compiler a worker started, a helper of a helper); one nobody
        waits for stays a zombie, holding its pid, until the container ends."""
        ours = {c.process.pid: c.process for c in self.children
                if c.process is not None and c.process.returncode is None}
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # no child at all
                return
            if pid == 0:  # none has exited
                return
            if pid in ours:
                ours[pid].returncode = os.waitstatus_to_exitcode(status)
            else:
                log.debug("reaped an orphan (pid %d)", pid, extra={"pid": pid})

    def _on_exit(self, child: _Child, code: int, now: float) -> None:
        ran_s = now - child.started_at
        child.process = None
        if self._is_configuration_error(child, code, ran_s):
            log.error("%s failed on its first start, before it was ever ready (exit code %s "
                      "after %.1fs); stopping", child.spec.name, code, ran_s,
                      extra={"child": child.spec.name})
            self.exit_code = 1
            return
        if ran_s >= self.policy.stable_after_s:
            delay = 0.0
            child.backoff_s = self.policy.initial_backoff_s
        else:
            delay = child.backoff_s
            child.backoff_s = min(child.backoff_s * 2, self.policy.max_backoff_s)
        log.warning("%s exited with code %s after %.1fs; restarting in %.1fs",
                    child.spec.name, code, ran_s, delay,
                    extra={"child": child.spec.name, "exit_code": code})
        child.restart_at = now + delay

    def _is_configuration_error(self, child: _Child, code: int, ran_s: float) -> bool:
        return (child.num_starts == 1 and not child.has_been_ready and code > 0
                and ran_s < self.policy.startup_window_s)

    def _notice_loop(self) -> None:
        """Tell `exit_notice` of each child's exit, in order, off the main loop."""
        while (item := self._exits.get()) is not None:
            try:
                self.exit_notice(*item)
            except Exception:  # a notice's bug must not take the supervisor down
                log.exception("exit notice failed")

    def _probe_loop(self) -> None:
        """Learn which children have been ready; ends once every one has been."""
        while not self._stopping.is_set():
            pending = {c.spec.name: c for c in self.children if not c.has_been_ready}
            if not pending:
                return
            processes = {name: c.process for name, c in pending.items()}
            pids = {name: p.pid for name, p in processes.items() if p is not None}
            try:
                ready = self.readiness(pids) if pids else set()
            except Exception:  # a probe's bug must not take the supervisor down
                log.exception("readiness probe failed")
                ready = set()
            for name in ready & pids.keys():
                pending[name].has_been_ready = True
                log.info("%s is ready", name, extra={"child": name})
            self._stopping.wait(self.policy.probe_interval_s)

    def _watch_loop(self) -> None:
        """Kill a child that the unresponsive probe names with the same pid for longer than
        `unresponsive_timeout_s` in a row (a SIGSTOPped or hung worker the gateway marked
        lost or stalled: it would never exit by itself). The main loop sends the SIGKILL, so
        a pid is never signalled after it was reaped; the exit restarts it as any other."""
        limit = self.policy.unresponsive_timeout_s
        assert self.unresponsive is not None and limit is not None
        since: dict[str, tuple[int, float]] = {}  # name -> (pid, first seen unresponsive)
        while not self._stopping.wait(self.policy.watch_interval_s):
            children = {c.spec.name: c for c in self.children}
            processes = {name: c.process for name, c in children.items()}
            pids = {name: p.pid for name, p in processes.items() if p is not None}
            try:
                bad = self.unresponsive(pids) if pids else set()
            except Exception:  # a probe's bug must not take the supervisor down
                log.exception("unresponsive probe failed")
                continue
            if bad is None:
                continue  # the gateway did not answer: nothing known, nothing counted
            now = time.monotonic()
            since = {name: (pid, at) for name, (pid, at) in since.items()
                     if name in bad and pids.get(name) == pid}
            for name in bad & pids.keys():
                pid, first_at = since.setdefault(name, (pids[name], now))
                if now - first_at < limit:
                    continue
                log.error("%s (pid %d) has been lost or stalled in the gateway's view for "
                          "%.0fs; killing it so that it is restarted", name, pid, now - first_at,
                          extra={"child": name, "pid": pid})
                children[name].kill_pid = pid
                del since[name]
                self._wake()

    def _start(self, child: _Child) -> None:
        env = {**os.environ, **(child.spec.env or {}), PARENT_PID_ENV: str(os.getpid())}
        child.process = subprocess.Popen(list(child.spec.argv), env=env, start_new_session=True)
        child.started_at = time.monotonic()
        child.num_starts += 1
        child.restart_at = None
        log.info("started %s (pid %d)", child.spec.name, child.process.pid,
                 extra={"child": child.spec.name, "pid": child.process.pid,
                        "start": child.num_starts})

    def stop(self) -> None:
        """Stop children phase by phase: SIGTERM, wait up to their stop timeout, SIGKILL."""
        for phase in sorted({c.spec.stop_phase for c in self.children}):
            group = [c for c in self.children if c.spec.stop_phase == phase]
            for child in group:
                child.restart_at = None
                _send(child, signal.SIGTERM)
            deadline = time.monotonic() + max(c.spec.stop_timeout_s for c in group)
            for child in group:
                if child.process is None:
                    continue
                try:
                    child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in time; killing it", child.spec.name,
                                extra={"child": child.spec.name})
                    _send(child, signal.SIGKILL)
                    child.process.wait()
                log.info("%s stopped (exit code %s)", child.spec.name, child.process.returncode,
                         extra={"child": child.spec.name})
                child.process = None


def _send(child: _Child, sig: int) -> None:
    if child.process is not None and child.process.poll() is None:
        try:
            child.process.send_signal(sig)
        except ProcessLookupError:
            pass


def die_with_parent() -> None:
    """In a child started by the Supervisor: die (SIGKILL) when the supervisor dies.

    PR_SET_PDEATHSIG on Linux; elsewhere a thread that watches the parent pid.
    """
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl failed")
    except (OSError, AttributeError):
        threading.Thread(target=_watch_parent, args=(int(parent),), daemon=True,
                         name="parent-watch").start()
    # The parent may have died before prctl took effect.
    if os.getppid() != int(parent):
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)
