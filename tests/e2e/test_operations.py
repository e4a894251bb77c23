"""Operator commands end to end: `zeroserve workers ...` against `zeroserve serve` (two
workers, fake backend), under load. One server for the module, used in order."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from tests.e2e.helpers import stream_completion
from zeroserve.cli.harness import REPO_ROOT, child_env, zeroserve_argv

pytestmark = pytest.mark.slow

ADMIN_KEY = "operator-secret"


@pytest.fixture(scope="module")
def server(module_servers):
    return module_servers(args=("--backend", "fake", "--device", "cpu", "--workers", "2",
                                "--num-kv-blocks", "512", "--fake-forward-ms", "5",
                                "--admin-key", ADMIN_KEY), num_workers=2)


def workers_cli(server, *args: str, key: str | None = ADMIN_KEY,
                timeout_s: float = 120) -> subprocess.CompletedProcess:
    argv = zeroserve_argv("workers", *args, "--url", server.url)
    if key is not None:
        argv += ["--admin-key", key]
    return subprocess.run(argv, cwd=REPO_ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=timeout_s)


class SteadyLoad:
    """Clients in closed loop, each streaming one completion after another."""

    def __init__(self, url: str, num_clients: int = 4, max_tokens: int = 60):
        self.url, self.max_tokens = url, max_tokens
        self.results = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(num_clients)]
        for thread in self._threads:
            thread.start()

    def _client(self, i: int) -> None:
        while not self._stop.is_set():
            body = {"prompt": f"Client {i} says", "max_tokens": self.max_tokens,
                    "stream_options": {"include_usage": True}}
            self.results.append(stream_completion(self.url, body, timeout_s=60))

    def stop(self) -> list:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)
        return self.results


def assert_all_succeeded(results, max_tokens: int) -> None:
    failed = [r for r in results if r.exception or r.error or not r.is_done
              or (r.usage or {}).get("completion_tokens") != max_tokens]
    assert results and not failed, failed[:3]


def test_admin_calls_without_the_key_are_refused(server):
    for key in (None, "wrong-key"):
        result = workers_cli(server, "list", key=key)
        assert result.returncode != 0 and "401" in result.stderr
    listed = workers_cli(server, "list")
    assert listed.returncode == 0 and "worker-0" in listed.stdout and "worker-1" in listed.stdout


def test_drain_sends_new_work_elsewhere_and_undrain_takes_it_back(server):
    assert workers_cli(server, "drain", "worker-0", "--deadline", "5").returncode == 0
    server.wait_for(lambda ws: {w["worker_id"]: w["status"] for w in ws}.get("worker-0")
                    == "draining", 5, "worker-0 draining")
    load = SteadyLoad(server.url)
    time.sleep(1.0)
    # The clients run in step (one batch, finished together), so one look can fall in the
    # moment between their requests: look a few times over a second.
    looks = []
    for _ in range(10):
        looks.append({w["worker_id"]: w["num_in_flight"] for w in server.workers()})
        time.sleep(0.1)
    assert all(busy["worker-0"] == 0 for busy in looks), looks
    assert any(busy["worker-1"] > 0 for busy in looks), looks
    assert workers_cli(server, "undrain", "worker-0").returncode == 0
    server.wait_for(lambda ws: any(w["worker_id"] == "worker-0" and w["num_in_flight"] > 0
                                   for w in ws), 10, "worker-0 takes work again")
    assert_all_succeeded(load.stop(), 60)


def test_a_rolling_restart_under_load_loses_no_request(server):
    pids = {w["worker_id"]: w["pid"] for w in server.workers()}
    load = SteadyLoad(server.url)
    time.sleep(1.0)
    result = workers_cli(server, "restart", "--all", "--deadline", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    time.sleep(1.0)
    results = load.stop()
    assert_all_succeeded(results, 60)
    after = {w["worker_id"]: w["pid"] for w in server.ready_workers()}
    assert set(after) == set(pids) and all(after[w] != pids[w] for w in pids)


def test_api_keys_without_an_admin_key_leave_the_admin_api_to_this_machine(zeroserve):
    """`serve --api-key K` and no --admin-key: an API key never operates workers, and the
    operator's `zeroserve workers ...` on the same machine needs no key."""
    import httpx

    api_key = "sk-customer"
    server = zeroserve(args=("--backend", "fake", "--device", "cpu", "--num-kv-blocks", "64"),
                       env={"ZEROSERVE_API_KEY": api_key}, wait=False)
    deadline = time.monotonic() + 120  # /health without a key says only the status
    while server.health()[0] != 200 and time.monotonic() < deadline:
        assert server.process.poll() is None, server.log_tail()
        time.sleep(0.25)
    listed = workers_cli(server, "list", key=None)
    assert listed.returncode == 0 and "worker-0" in listed.stdout, listed.stderr
    drained = workers_cli(server, "drain", "worker-0", key=None)
    assert drained.returncode == 0, drained.stderr
    assert "draining" in workers_cli(server, "list", key=None).stdout
    assert workers_cli(server, "undrain", "worker-0", key=None).returncode == 0
    # Through a proxy on this machine, a customer with a valid API key is refused.
    r = httpx.post(server.url + "/admin/workers/worker-0/drain", json={},
                   headers={"Authorization": f"Bearer {api_key}",
                            "X-Forwarded-For": "203.0.113.7"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_forbidden"
