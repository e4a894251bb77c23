"""Start, wait for and stop zeroserve servers: the one harness of the scripts and the tests.

`start_server(...)` runs `zeroserve serve` (or `gateway`, `worker`, any command) as a
subprocess of this checkout on a free port, waits until the wanted number of workers is
ready in /health, and returns a `ServerProcess` whose `stop()` always cleans up: SIGTERM,
then SIGKILL of its process group, then of any worker pid the server ever reported.
`ServerProcess(argv, ...)` does the same for any HTTP server (llama-server, the transformers
baseline) that `wait_answering` can wait for.

Children run with this checkout importable, unbuffered, and without our ZEROSERVE_*
settings, so a benchmark or a test sees only the flags and `env` it passes. tests/conftest.py
wraps this module in fixtures; it imports no pytest and nothing of ours, and builds every
command line from `LAUNCHER_MODULE`.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

# The package `python -m` runs for a `zeroserve` command (its __main__ is the console script).
LAUNCHER_MODULE = "zeroserve.cli"
REPO_ROOT = Path(__file__).resolve().parents[1]


class ServerError(RuntimeError):
    """A server exited or was not ready in time; `why` says which, str() adds its log."""

    def __init__(self, why: str, log_tail: str = ""):
        super().__init__(f"{why}:\n{log_tail}" if log_tail else why)
        self.why = why


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free on 127.0.0.1 now, outside the kernel's ephemeral range.

    A port the kernel handed out for `bind(0)` sits in the range it also gives to outgoing
    connections, so between our probe and the server's bind any client socket of the suite
    could take it ("address already in use"). Ports below the range are never given to a
    client, and each is handed out once per process."""
    return free_ports_on(["127.0.0.1"], 1)[0]


def free_ports_on(ips: list[str], count: int) -> list[int]:
    """`count` distinct ports free on every one of `ips` (hosts or pods that bind the same
    ports on their own addresses), outside the ephemeral range as `free_port`'s are."""
    import random

    low, high = _ephemeral_range()
    candidates = (10000, low - 1) if low > 12000 else (high + 1, 65535)
    ports: list[int] = []
    for _ in range(200 * count):
        port = random.randint(*candidates)
        if port in _handed_out or not _is_free_on(ips, port):
            continue
        _handed_out.add(port)
        ports.append(port)
        if len(ports) == count:
            return ports
    while len(ports) < count:  # a box with no room outside the range: the kernel's pick
        with socket.socket() as s:
            s.bind((ips[0], 0))
            port = s.getsockname()[1]
        if port not in ports and _is_free_on(ips, port):
            ports.append(port)
    return ports


def _is_free_on(ips: list[str], port: int) -> bool:
    socks = []
    try:
        for ip in ips:
            s = socket.socket()
            socks.append(s)
            s.bind((ip, port))
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()
    return True


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our environment without ZEROSERVE_* settings, with the repo importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROSERVE_")}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def zeroserve_argv(command: str, *args: str) -> list[str]:
    """`zeroserve COMMAND ARGS...` run by this Python from this checkout."""
    return [sys.executable, "-m", LAUNCHER_MODULE, command, *args]


def get_status(url: str, timeout_s: float = 2.0) -> int:
    """The HTTP status of GET url; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


_SECRET_FLAGS = ("--api-key", "--admin-key")


def _redacted(argv: list[str]) -> list[str]:
    """argv for a log line: the values of key flags replaced (a log must never hold a key)."""
    out = []
    for i, arg in enumerate(argv):
        if i > 0 and argv[i - 1] in _SECRET_FLAGS:
            out.append("***")
        elif arg.startswith(tuple(f + "=" for f in _SECRET_FLAGS)):
            out.append(arg.partition("=")[0] + "=***")
        else:
            out.append(arg)
    return out


class ServerProcess:
    """One server process (and, for `serve`, its supervised children) in its own session.

    Its output goes to `log_path` (appended, after a `$ command` line), or to ours when
    `log_path` is None. It runs in `cwd` (this checkout by default; another checkout for
    benchmarks/bench_commits.py, whose `env` then makes that one importable).
    """

    def __init__(self, argv: list[str], port: int, log_path: Path | None,
                 env: dict[str, str] | None = None, cwd: Path | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(log_path, "ab")  # noqa: SIM115 (closed in stop())
            self._log.write(f"$ {shlex.join(_redacted(argv))}\n".encode())
            self._log.flush()
        stderr = subprocess.STDOUT if self._log is not None else None
        # Its own process group, so teardown can take down everything it started directly.
        self.process = subprocess.Popen(argv, cwd=cwd or REPO_ROOT, env=child_env(env),
                                        stdout=self._log, stderr=stderr, start_new_session=True)
        self.seen_worker_pids: set[int] = set()
        self._is_terminated = False

    # -- state ------------------------------------------------------------------------------

    def health(self) -> tuple[int, dict | None]:
        """(HTTP status, JSON body); (0, None) when nothing answers."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.loads(e.read())
            except ValueError:
                return e.code, None
        except (OSError, ValueError):
            return 0, None

    def workers(self) -> list[dict]:
        _, body = self.health()
        workers = (body or {}).get("workers", [])
        self.seen_worker_pids.update(w["pid"] for w in workers if "pid" in w)
        return workers

    def ready_workers(self) -> list[dict]:
        return [w for w in self.workers() if w.get("status") == "ready"]

    def wait_ready(self, num_workers: int = 1, timeout_s: float = 120.0) -> None:
        """Until /health lists `num_workers` ready workers."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_running()
            if len(self.ready_workers()) >= num_workers:
                return
            time.sleep(0.25)
        raise ServerError(f"server not ready within {timeout_s}s", self.log_tail())

    def wait_answering(self, paths: tuple[str, ...] = ("/health",), timeout_s: float = 120.0,
                       num_in_a_row: int = 1) -> None:
        """Until every path answers 200, `num_in_a_row` times running (each time on a new
        connection, which the kernel may give any of the processes sharing the port)."""
        deadline = time.monotonic() + timeout_s
        num_ok = 0
        while time.monotonic() < deadline:
            self._check_running()
            is_ok = all(get_status(self.url + path) == 200 for path in paths)
            num_ok = num_ok + 1 if is_ok else 0
            if num_ok >= num_in_a_row:
                return
            time.sleep(0.02 if is_ok else 0.2)
        raise ServerError(f"{' and '.join(paths)} not answering 200 within {timeout_s}s",
                          self.log_tail())

    def wait_for(self, predicate: Callable[[list[dict]], bool], timeout_s: float,
                 what: str) -> float:
        """Poll /health until predicate(workers) holds; returns the seconds it took."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if predicate(self.workers()):
                return time.monotonic() - started
            time.sleep(0.05)
        raise ServerError(f"{what}: not within {timeout_s}s; workers: {self.workers()}",
                          self.log_tail())

    def _check_running(self) -> None:
        if self.process.poll() is not None:
            raise ServerError(f"server exited with {self.process.returncode}",
                              self.log_tail())

    def log_tail(self, num_lines: int = 80) -> str:
        if self._log is None:
            return ""
        if not self._log.closed:
            self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    # -- teardown ---------------------------------------------------------------------------

    def terminate(self) -> None:
        """SIGTERM, once: a second one would tell a worker or `serve` to stop at once."""
        if self.process.poll() is None and not self._is_terminated:
            self.process.send_signal(signal.SIGTERM)
            self._is_terminated = True

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM and wait; then SIGKILL whatever is left. Returns the exit code."""
        self.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        # Supervised children die with their parent (PDEATHSIG); make sure of it anyway.
        for pid in self.seen_worker_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log is not None:
            self._log.close()
        return self.process.returncode


def start_server(log_dir: Path | None = None, command: str = "serve",
                 args: tuple[str, ...] = (), num_workers: int = 1, port: int | None = None,
                 wait: bool = True, env: dict[str, str] | None = None,
                 timeout_s: float = 120.0, log_path: Path | None = None) -> ServerProcess:
    """`zeroserve COMMAND ARGS` on `port` (a free one by default), its output in `log_path`
    or else `log_dir/COMMAND-PORT.log` (ours with neither); with `wait`, ready with
    `num_workers` workers, or stopped and a ServerError raised."""
    port = port or free_port()
    if log_path is None and log_dir is not None:
        log_path = log_dir / f"{command}-{port}.log"
    argv = zeroserve_argv(command, *args)
    if command in ("serve", "gateway") and "--port" not in args:
        argv += ["--port", str(port)]
    server = ServerProcess(argv, port, log_path, env)
    if wait:
        try:
            server.wait_ready(num_workers, timeout_s)
        except BaseException:
            server.stop(timeout_s=5)
            raise
    return server
