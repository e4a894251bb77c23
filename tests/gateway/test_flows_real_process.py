"""Fair shares across keys end to end, real processes (issue 39): `zeroserve serve --backend
fake` with a two-sequence worker whose batch key A holds with long streams (and more of A's
queued); key B's short request of the same class takes a slot of A's at once and ends while
A's streams still run, and A's streams still end whole. With fcfs, B waits for one of A's."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.gateway.test_priority_real_process import wait_served
from zeroserve.cli.harness import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
KEY_A, KEY_B = "sk-a", "sk-b"


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_light_key_gets_a_slot_of_a_key_holding_the_batch(tmp_path, policy):
    server = start_server(args=(
        "--backend", "fake", "--fake-forward-ms", "20", "--max-num-seqs", "2",
        "--max-waiting-per-worker", "1", "--served-model-name", "fake",
        "--scheduling-policy", policy, "--api-key", f"{KEY_A},{KEY_B}"),
        wait=False, log_dir=tmp_path)
    try:
        wait_served(server.url, KEY_A)
        started: set[str] = set()
        done: dict[str, tuple[float, int]] = {}

        def stream(name: str, key: str, max_tokens: int) -> None:
            num_tokens = 0
            with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"model": "fake", "prompt": f"Story {name}.",
                                    "max_tokens": max_tokens, "ignore_eos": True,
                                    "stream": True,
                                    "stream_options": {"include_usage": True}}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        started.add(name)
                        usage = json.loads(line[len("data: "):]).get("usage")
                        if usage:
                            num_tokens = usage["completion_tokens"]
            done[name] = (time.monotonic(), num_tokens)

        a = [threading.Thread(target=stream, args=(f"a{i}", KEY_A, 150)) for i in range(4)]
        for thread in a[:2]:
            thread.start()
        deadline = time.monotonic() + 30
        while not {"a0", "a1"} <= started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert {"a0", "a1"} <= started  # the batch is A's (150 steps of 20 ms each)
        for thread in a[2:]:
            thread.start()  # and A has more waiting, in the worker and in the gateway
        stream("b", KEY_B, 5)
        a_done_before_b = [name for name in done if name.startswith("a")]
        for thread in a:
            thread.join(120)
        assert [done[f"a{i}"][1] for i in range(4)] == [150] * 4  # every A stream whole
        if policy == "fair":
            assert a_done_before_b == []  # B did not wait for a slot of A's to free
        else:
            assert a_done_before_b  # fcfs: B waited behind A's requests
    finally:
        server.stop(timeout_s=10)
