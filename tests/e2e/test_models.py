"""Two real models behind one gateway, in real processes: two tiny ones built here (random
Llamas of different seeds over a byte-level tokenizer, so their greedy outputs differ and
show which model answered; the embedded model would spend most of a minute loading on two
busy cores): routing by name, the 404, /v1/models, an alias's stickiness, and a killed
worker's streams staying on its model. One server for the module."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from tests.worker.conftest import write_tiny_chat_model as write_tiny_model

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def server(module_servers, tmp_path_factory):
    default = write_tiny_model(tmp_path_factory.mktemp("default"), seed=0)
    tiny = write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1)
    return module_servers(args=(
        "--model", str(default), "--device", "cpu", "--served-model-name", "smollm",
        "--max-model-len", "512",
        "--num-kv-blocks", "64", "--add-model", f"tiny={tiny}:2",
        "--model-alias", "chat=smollm:50,tiny:50"), num_workers=3, timeout_s=180,
        env={"ZEROSERVE_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))})


def complete(server, model: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=60,
                      json={"model": model, "prompt": "Hello", "max_tokens": 4, **body})


def routed(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {m: float(v) for m, v in re.findall(
        r'^zeroserve:model_requests_total\{model_name="([^"]+)",version="v1"\} (\S+)$', text,
        re.MULTILINE)}


def test_two_models_route_by_name(server):
    cards = [c["id"] for c in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert cards == ["smollm", "tiny", "chat"]
    before = routed(server)
    texts = {}
    for model in ("smollm", "tiny", "tiny"):
        response = complete(server, model, temperature=0, ignore_eos=True)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        texts.setdefault(model, set()).add(response.json()["choices"][0]["text"])
    assert len(texts["tiny"]) == 1 and texts["tiny"] != texts["smollm"]  # two models
    after = routed(server)
    assert after["smollm"] - before.get("smollm", 0) == 1
    assert after["tiny"] - before.get("tiny", 0) == 2
    missing = complete(server, "nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_an_alias_sticks_per_user(server):
    before = routed(server)
    for i in range(6):
        for _ in range(2):
            assert complete(server, "chat", user=f"u{i}", max_tokens=1).status_code == 200
    after = routed(server)
    delta = {m: after.get(m, 0) - before.get(m, 0) for m in ("smollm", "tiny")}
    assert sum(delta.values()) == 12 and all(d % 2 == 0 for d in delta.values()), delta


def test_a_killed_workers_streams_stay_on_its_model(server):
    tiny_workers = [w for w in server.workers() if w["served_model_name"] == "tiny"]
    assert len(tiny_workers) == 2
    before = routed(server)
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "Go", "max_tokens": 200, "stream": True,
            "ignore_eos": True}) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        victim = next(w for w in server.workers()
                      if w["served_model_name"] == "tiny" and w["num_in_flight"])
        os.kill(victim["pid"], signal.SIGKILL)
        body = "\n".join(lines)
    assert "[DONE]" in body and '"error"' not in body
    after = routed(server)
    assert after.get("smollm", 0) == before.get("smollm", 0)  # never the other model


def test_every_gateway_of_a_tier_applies_a_weight_change(zeroserve):
    """`serve --gateways 2`: a set-weights call reaches one gateway (whichever the kernel
    gives the connection); both answer with the new weights soon after."""
    from zeroserve.cli.admin_client import AdminClient

    tier = zeroserve(args=("--backend", "fake", "--device", "cpu", "--gateways", "2",
                           "--add-model", "tiny=default",
                           "--model-alias", "chat=SmolLM2-135M-Instruct:100"), num_workers=1)

    def weights_seen() -> list[dict]:  # a new connection each: both gateways answer some
        return [httpx.get(f"{tier.url}/v1/models/chat", headers={"connection": "close"},
                          timeout=10).json()["weights"] for _ in range(16)]

    assert all(w == {"SmolLM2-135M-Instruct": 100.0} for w in weights_seen())
    AdminClient(tier.url).set_weights("chat", {"tiny": 1})
    # Polled (the other gateway reads the shared file within half a second here), with a
    # deadline generous for a loaded machine.
    deadline = time.monotonic() + 20
    while not all(w == {"tiny": 1.0} for w in weights_seen()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(w == {"tiny": 1.0} for w in weights_seen())
