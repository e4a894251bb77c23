"""`serve` and `gateway` on tcp:// as a user runs them: keys or nothing (fake backend)."""

from __future__ import annotations

import re
import subprocess

import httpx
import pytest

from tests.conftest import REPO_ROOT, child_env, free_port, zeroserve_argv
from tests.e2e.helpers import MODEL

pytestmark = pytest.mark.slow


def test_serve_on_tcp_without_keys_uses_an_ephemeral_key_set(zeroserve):
    router, tokens = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    server = zeroserve(args=("--backend", "fake", "--device", "cpu", "--workers", "2",
                             "--router-address", router, "--tokens-address", tokens))
    response = httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "Hello", "max_tokens": 5})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
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
