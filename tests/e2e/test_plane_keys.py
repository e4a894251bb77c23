"""`serve` and `gateway` on tcp:// as a user runs them: keys or nothing (fake backend)."""

from __future__ import annotations

import re
import subprocess
import time

import httpx
import pytest

from tests.e2e.helpers import MODEL
from zeroserve.cli.harness import REPO_ROOT, child_env, free_port, zeroserve_argv

pytestmark = pytest.mark.slow


def test_serve_on_tcp_without_keys_uses_an_ephemeral_key_set(zeroserve):
    router, tokens = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    server = zeroserve(args=("--backend", "fake", "--device", "cpu", "--workers", "2",
                             "--router-address", router, "--tokens-address", tokens))
    response = httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "Hello", "max_tokens": 5})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
    server.wait_ready(num_workers=2, timeout_s=60)  # the second may finish its HELLO later
    assert len(server.ready_workers()) == 2
    key_dir = re.search(r"ephemeral key set in (\S+)", server.log_tail(200)).group(1)
    assert (REPO_ROOT / key_dir).joinpath("gateway.key_secret").exists()
    server.stop()
    assert not (REPO_ROOT / key_dir).exists()  # removed when serve exits


def test_a_gateway_on_tcp_without_keys_refuses_to_start():
    result = subprocess.run(zeroserve_argv("gateway", "--router-address", "tcp://127.0.0.1:5",
                                           "--port", str(free_port())),
                            cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and "--keys-dir" in result.stderr and "--insecure" in \
        result.stderr


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_hostile_peers_leave_the_gateways_memory_flat(zeroserve, tmp_path):
    import zmq

    from zeroserve.common.keys import curve_client, generate, load_worker_keys

    key_dir = generate(tmp_path / "keys", ["worker-0", "worker-1"])
    router, tokens = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    server = zeroserve(command="gateway", num_workers=0, wait=False,
                       args=("--keys-dir", str(key_dir), "--router-address", router,
                             "--tokens-address", tokens))
    deadline = time.monotonic() + 60
    while server.health()[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    before = _rss_mb(server.process.pid)
    ctx = zmq.Context()
    try:
        keyed = load_worker_keys(key_dir, "worker-1")
        for i in range(20):  # oversized frames from a keyed peer, junk from keyless ones
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 500)
            if i % 2:
                curve_client(sock, keyed)
            sock.connect(router if i % 4 < 2 else tokens)
            try:
                sock.send(b"\x00" * (32 * 2**20))
                for _ in range(200):
                    sock.send_multipart([b"\x07", b"\xc1" * 100])
            except zmq.Again:
                pass  # a peer the gateway never let in cannot send at all
    finally:
        ctx.destroy(linger=2000)
    time.sleep(2.0)
    assert server.health()[0] in (200, 503)  # alive and answering
    assert _rss_mb(server.process.pid) - before < 64  # nothing buffered: 640 MiB were sent
