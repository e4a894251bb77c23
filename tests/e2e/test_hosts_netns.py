"""Workers on other hosts over tcp:// with CurveZMQ keys, with network namespaces as hosts.

Three namespaces joined by veth pairs: the gateway's "host" and two worker hosts (the fake
backend), and one more pair from the test's own namespace to the gateway for HTTP. While
streams run, one host's worker is killed (-9) and the other host's link is cut for a few
seconds and healed. Every stream must end, resumed to its full length or with a clear error
event, and nothing may hang; afterwards the healed worker serves new requests.

Needs root and iproute2 (`ip netns`); skips where namespaces cannot be made.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.helpers import StreamResult, stream_completion
from zeroserve.cli.harness import REPO_ROOT, child_env, zeroserve_argv

pytestmark = pytest.mark.slow

MAX_TOKENS = 120
NUM_STREAMS = 12
ROUTER_PORT, TOKENS_PORT, HTTP_PORT = 5555, 5556, 8000


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=check)


def can_make_namespaces() -> str | None:
    """None if this machine can make network namespaces, else why not."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (the `ip` command)"
    probe = f"zsprobe{os.getpid()}"
    try:
        made = run("ip", "netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot make a network namespace: {made.stderr.strip()}"
    finally:
        run("ip", "netns", "del", probe, check=False)
    return None


class Hosts:
    """Namespaces gw, a, b; veth links client<->gw, gw<->a, gw<->b on their own subnets."""

    def __init__(self) -> None:
        tag = f"zs{os.getpid() % 10000}"
        self.ns = {name: f"{tag}{name}" for name in ("gw", "a", "b")}
        octet = 100 + os.getpid() % 100
        self.net = f"10.{octet}"
        self.gw_http = f"{self.net}.0.2"
        self.gw_side = {"a": f"{tag}ga", "b": f"{tag}gb"}  # the gateway end of each link
        self._client_if = f"{tag}c"
        try:
            self._build(tag)
        except BaseException:
            self.close()
            raise

    def _build(self, tag: str) -> None:
        for ns in self.ns.values():
            run("ip", "netns", "add", ns)
            self.exec(ns, "ip", "link", "set", "lo", "up")
        # The test (HTTP client) <-> the gateway's host.
        run("ip", "link", "add", self._client_if, "type", "veth", "peer", "name", f"{tag}cg")
        run("ip", "link", "set", f"{tag}cg", "netns", self.ns["gw"])
        run("ip", "addr", "add", f"{self.net}.0.1/24", "dev", self._client_if)
        run("ip", "link", "set", self._client_if, "up")
        self.exec(self.ns["gw"], "ip", "addr", "add", f"{self.gw_http}/24", "dev", f"{tag}cg")
        self.exec(self.ns["gw"], "ip", "link", "set", f"{tag}cg", "up")
        # The gateway's host <-> each worker host.
        for k, host in enumerate(("a", "b"), start=1):
            gw_if, w_if = self.gw_side[host], f"{tag}w{host}"
            run("ip", "link", "add", gw_if, "type", "veth", "peer", "name", w_if)
            run("ip", "link", "set", gw_if, "netns", self.ns["gw"])
            run("ip", "link", "set", w_if, "netns", self.ns[host])
            self.exec(self.ns["gw"], "ip", "addr", "add", f"{self.net}.{k}.1/24", "dev", gw_if)
            self.exec(self.ns[host], "ip", "addr", "add", f"{self.net}.{k}.2/24", "dev", w_if)
            self.exec(self.ns["gw"], "ip", "link", "set", gw_if, "up")
            self.exec(self.ns[host], "ip", "link", "set", w_if, "up")

    def gateway_address(self, host: str) -> str:
        """The gateway's address as the worker host sees it."""
        return f"{self.net}.{('a', 'b').index(host) + 1}.1"

    def exec(self, ns: str, *argv: str) -> subprocess.CompletedProcess:
        return run("ip", "netns", "exec", ns, *argv)

    def set_link(self, host: str, is_up: bool) -> None:
        self.exec(self.ns["gw"], "ip", "link", "set", self.gw_side[host],
                  "up" if is_up else "down")

    def spawn(self, host: str, argv: list[str], log: Path) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns[host], *argv], cwd=REPO_ROOT,
                                env=child_env(), stdout=open(log, "wb"),
                                stderr=subprocess.STDOUT)

    def close(self) -> None:
        for ns in self.ns.values():
            run("ip", "netns", "del", ns, check=False)
        run("ip", "link", "del", self._client_if, check=False)


@pytest.fixture
def hosts():
    why = can_make_namespaces()
    if why is not None:
        pytest.skip(why)
    try:
        h = Hosts()
    except subprocess.CalledProcessError as e:  # e.g. no veth support in this kernel
        pytest.skip(f"cannot build the hosts: {' '.join(e.cmd)}: {e.stderr.strip()}")
    yield h
    h.close()


def zeroserve(*args: str) -> list[str]:
    return zeroserve_argv(*args)


def health(url: str) -> dict:
    try:
        return httpx.get(url + "/health", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return {}


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s}s: {what}")


def ready_ids(url: str) -> set[str]:
    return {w["worker_id"] for w in health(url).get("workers", []) if w["status"] == "ready"}


def test_streams_survive_a_dead_worker_host_and_a_cut_link(hosts: Hosts, tmp_path: Path):
    from zeroserve.common.keys import generate

    key_dir = generate(tmp_path / "keys", ["host-a", "host-b"])
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["gw"] = hosts.spawn("gw", zeroserve(
            "gateway", "--host", "0.0.0.0", "--port", str(HTTP_PORT),
            "--router-address", f"tcp://0.0.0.0:{ROUTER_PORT}",
            "--tokens-address", f"tcp://0.0.0.0:{TOKENS_PORT}", "--keys-dir", str(key_dir),
            "--worker-timeout", "1.5", "--queue-timeout", "30"), tmp_path / "gateway.log")
        for host in ("a", "b"):
            address = hosts.gateway_address(host)
            procs[host] = hosts.spawn(host, zeroserve(
                "worker", "--worker-id", f"host-{host}", "--backend", "fake",
                "--fake-forward-ms", "20", "--device", "cpu", "--keys-dir", str(key_dir),
                "--router-address", f"tcp://{address}:{ROUTER_PORT}",
                "--tokens-address", f"tcp://{address}:{TOKENS_PORT}"),
                tmp_path / f"worker-{host}.log")
        url = f"http://{hosts.gw_http}:{HTTP_PORT}"
        wait_until(lambda: ready_ids(url) == {"host-a", "host-b"}, 120, "both workers ready")

        results = [StreamResult() for _ in range(NUM_STREAMS)]
        threads = [threading.Thread(target=stream_completion, daemon=True, args=(url, {
            "prompt": f"Stream {i} says", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream_options": {"include_usage": True}}, r), kwargs={"timeout_s": 90})
            for i, r in enumerate(results)]
        for t in threads:
            t.start()
        wait_until(lambda: all(len(r.chunks) >= 5 for r in results), 60, "streams flowing")

        procs["a"].send_signal(signal.SIGKILL)  # host a's worker dies
        time.sleep(0.5)
        hosts.set_link("b", is_up=False)  # host b drops off the network...
        time.sleep(3.0)
        hosts.set_link("b", is_up=True)  # ...and comes back

        for t in threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in threads), "a stream hung"
        for i, r in enumerate(results):
            assert r.exception is None, (i, r.exception)
            assert r.is_done, i  # the stream ended properly ([DONE]), not cut off
            if r.error is None:  # resumed: the whole completion, counted once
                assert r.finish_reason == "length", (i, r.chunks[-3:])
                assert r.usage["completion_tokens"] == MAX_TOKENS, (i, r.usage)
            else:  # or told why
                assert r.error.get("message"), (i, r.error)
        # Streams moved on (not all failed), and the healed worker serves new work.
        assert sum(r.error is None for r in results) >= NUM_STREAMS // 2, \
            [r.error for r in results]
        wait_until(lambda: "host-b" in ready_ids(url), 30, "host b ready again")
        after = httpx.post(url + "/v1/completions", timeout=30, json={
            "prompt": "After", "max_tokens": 8, "ignore_eos": True})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
