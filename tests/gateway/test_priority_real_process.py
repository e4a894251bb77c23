"""Priority end to end, real processes: `zeroserve serve --backend fake` with a one-sequence
worker; a critical key's request takes the batch's only slot from a sheddable stream already
running, finishes first, and the sheddable stream still ends whole (recomputed)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from zeroserve.cli.harness import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
CRITICAL, SHEDDABLE = "sk-critical", "sk-sheddable"


def wait_served(url: str, key: str, deadline_s: float = 120.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            r = httpx.post(url + "/v1/completions", timeout=10,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"model": "fake", "prompt": "hi", "max_tokens": 1})
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError("the server served nothing")


def test_a_critical_request_takes_the_slot_of_a_running_sheddable_one(tmp_path):
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({CRITICAL: {"priority_class": "critical"},
                                  SHEDDABLE: {"priority_class": "sheddable"}}))
    server = start_server(args=(
        "--backend", "fake", "--fake-forward-ms", "20", "--max-num-seqs", "1",
        "--served-model-name", "fake", "--rate-limits", str(limits),
        "--api-key", f"{CRITICAL},{SHEDDABLE}"), wait=False, log_dir=tmp_path)
    try:
        wait_served(server.url, CRITICAL)
        done: dict[str, tuple[float, dict]] = {}

        def complete(name: str, key: str, max_tokens: int) -> None:
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"model": "fake", "prompt": "Tell me a story.",
                                 "max_tokens": max_tokens, "ignore_eos": True})
            done[name] = (time.monotonic(), r.json())

        batch = threading.Thread(target=complete, args=("sheddable", SHEDDABLE, 150))
        batch.start()
        time.sleep(0.5)  # it runs: about 25 of its 150 steps
        assert "sheddable" not in done
        complete("critical", CRITICAL, 5)
        assert "sheddable" not in done  # the critical one did not wait for it
        batch.join(60)
        assert done["sheddable"][0] > done["critical"][0]
        assert done["critical"][1]["usage"]["completion_tokens"] == 5
        assert done["sheddable"][1]["usage"]["completion_tokens"] == 150
    finally:
        server.stop(timeout_s=10)
