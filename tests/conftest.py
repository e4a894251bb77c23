"""Shared helpers for tests that run real zeroserve processes.

`start_server(...)` runs `zeroserve serve` (or `gateway` / `worker`) as a subprocess on a free
port, waits for /health, and returns a handle whose `stop()` always cleans up: SIGTERM,
then SIGKILL of the process group, then of any worker pid the server ever reported.
The `zeroserve` fixture hands out such servers and stops them at teardown.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our environment without ZEROSERVE_* settings, with the repo importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROSERVE_")}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def zeroserve_argv(command: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "zeroserve.cli", command, *args]


class ServerProcess:
    """One `zeroserve ...` process (and, for `serve`, its supervised children)."""

    def __init__(self, argv: list[str], port: int, log_path: Path,
                 env: dict[str, str] | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "ab")
        # Its own process group, so teardown can take down everything it started directly.
        self.process = subprocess.Popen(argv, cwd=REPO_ROOT, env=child_env(env),
                                        stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.seen_worker_pids: set[int] = set()

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
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}:\n"
                                     + self.log_tail())
            if len(self.ready_workers()) >= num_workers:
                return
            time.sleep(0.25)
        raise AssertionError(f"server not ready within {timeout_s}s:\n" + self.log_tail())

    def wait_for(self, predicate, timeout_s: float, what: str) -> float:
        """Poll /health until predicate(workers) holds; returns the seconds it took."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if predicate(self.workers()):
                return time.monotonic() - started
            time.sleep(0.05)
        raise AssertionError(f"{what}: not within {timeout_s}s; workers: {self.workers()}")

    def log_tail(self, num_lines: int = 80) -> str:
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    # -- teardown ---------------------------------------------------------------------------

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM and wait; then SIGKILL whatever is left. Returns the exit code."""
        self.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        for pid in [self.process.pid]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.process.wait()
        # Supervised children die with their parent (PDEATHSIG); make sure of it anyway.
        for pid in self.seen_worker_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._log.close()
        return self.process.returncode


def start_server(log_dir: Path, command: str = "serve", args: tuple[str, ...] = (),
                 num_workers: int = 1, port: int | None = None, wait: bool = True,
                 env: dict[str, str] | None = None, timeout_s: float = 120.0) -> ServerProcess:
    port = port or free_port()
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


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `cuda` are skipped, with the reason, where torch sees no CUDA GPU.

    torch is imported only when such a test was collected, so the gateway's tests stay light.
    """
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in cuda_items:
        item.add_marker(skip)


@pytest.fixture
def zeroserve(tmp_path) -> Iterator:
    """Factory: zeroserve(args=(...), num_workers=1) -> a ready ServerProcess."""
    servers: list[ServerProcess] = []

    def start(**kwargs) -> ServerProcess:
        server = start_server(tmp_path, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(timeout_s=10)


@pytest.fixture(scope="module")
def module_servers(tmp_path_factory) -> Iterator:
    """Like `zeroserve`, for servers shared by the tests of one module."""
    log_dir = tmp_path_factory.mktemp("servers")
    servers: list[ServerProcess] = []

    def start(**kwargs) -> ServerProcess:
        server = start_server(log_dir, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(timeout_s=10)
