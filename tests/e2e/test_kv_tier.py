"""The box's KV tier end to end (issue 37): `serve --workers 2 --kv-offloading-size ...` on a
tiny real model (a random 2-layer Llama over bytes), a streamed completion whose worker is
SIGKILLed mid-stream continues on the other worker from the tier, with exactly the tokens of
the undisturbed run, and the surviving worker reports tier hits on /metrics."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from tests.e2e.helpers import MODEL, stream_in_thread
from tests.worker.conftest import write_tiny_chat_model

pytestmark = pytest.mark.slow

# ~270 byte tokens (the tiny model's context is 512): its full blocks of 16 tokens.
PROMPT = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog. " for i in range(5))
NUM_PROMPT_BLOCKS = len(PROMPT.encode()) // 16
BODIES = {
    "greedy": {"prompt": PROMPT, "max_tokens": 160, "temperature": 0, "ignore_eos": True},
    "seeded": {"prompt": PROMPT, "max_tokens": 160, "temperature": 0.9, "seed": 7,
               "ignore_eos": True},
}


@pytest.fixture(scope="module")
def tier_server(module_servers, tmp_path_factory):
    model = write_tiny_chat_model(tmp_path_factory.mktemp("tier-model"), seed=3)
    tier = tmp_path_factory.mktemp("tier") / "kv"
    server = module_servers(args=(
        "--model", str(model), "--served-model-name", MODEL, "--device", "cpu",
        "--dtype", "float32", "--workers", "2",
        "--max-model-len", "512", "--num-kv-blocks", "256", "--kv-offloading-size", "0.05",
        "--kv-offloading-dir", str(tier)), num_workers=2, timeout_s=180,
        env={"ZEROSERVE_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))})
    return server, tier


def tier_hits(server, worker_id: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = re.search(rf'^zeroserve:kv_tier_hits_total\{{[^}}]*worker_id="{worker_id}"[^}}]*\}}'
                      r" (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def all_tier_hits(server) -> float:
    """Tier hits of both workers: the killed worker's stream continues on the other one or on
    its own restarted process, whichever the gateway picks; either loads from the tier."""
    return tier_hits(server, "worker-0") + tier_hits(server, "worker-1")


def wait_for_prompt_blocks(tier) -> None:
    """Until the stream's prompt blocks are in the tier (its worker writes them after each
    step, off the step's path)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(list(tier.glob("*.kv"))) < NUM_PROMPT_BLOCKS:
        time.sleep(0.05)


def stream_and_freeze(server, body: dict, after_chunks: int = 20) -> tuple[dict, str]:
    """Start a streamed completion and SIGSTOP both workers from the reading thread once
    `after_chunks` chunks arrived: the tiny model makes its 160 tokens in a fraction of a
    second, so a kill or drain sent later could find the stream already finished. -> (the
    frozen worker holding the stream, with "stream": (thread, result)), the other worker's
    id, which runs again."""
    pids = [w["pid"] for w in server.workers()]

    def freeze(num_chunks: int) -> None:
        if num_chunks == after_chunks:
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)

    thread, result = stream_in_thread(server.url, body, on_chunk=freeze)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(result.chunks) < after_chunks:
        time.sleep(0.01)
    assert len(result.chunks) >= after_chunks, result.error
    holder = next(w for w in server.workers() if w["num_in_flight"])  # as last heartbeated
    for w in server.workers():
        if w["worker_id"] != holder["worker_id"]:
            os.kill(w["pid"], signal.SIGCONT)
            other = w["worker_id"]
    return {**holder, "stream": (thread, result)}, other


def restart_all(server, tier) -> None:
    """Kill every worker and empty the tier: no worker's pool or the tier holds the prompt."""
    old = {w["worker_id"]: w["pid"] for w in server.workers()}
    for pid in old.values():
        os.kill(pid, signal.SIGKILL)
    server.wait_for(lambda ws: len(ws) == 2 and all(
        w["status"] == "ready" and w["pid"] != old.get(w["worker_id"]) for w in ws),
        timeout_s=120, what="both workers restarted")
    for path in tier.glob("*.kv"):
        path.unlink()


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_a_killed_workers_stream_continues_from_the_tier_with_the_same_tokens(
        tier_server, kind):
    server, tier = tier_server
    body = BODIES[kind]
    reference = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body},
                           timeout=120)
    assert reference.status_code == 200, reference.text
    expected = reference.json()["choices"][0]["text"]
    restart_all(server, tier)

    victim, _other = stream_and_freeze(server, body)
    thread, result = victim.pop("stream")
    wait_for_prompt_blocks(tier)
    hits_before = all_tier_hits(server)
    os.kill(victim["pid"], signal.SIGKILL)  # frozen mid-stream: it cannot have finished
    thread.join(timeout=120)

    assert result.exception is None and result.error is None, result.error
    assert result.text == expected  # exactly the undisturbed run's tokens
    assert "failover" in server.log_tail(2000)
    deadline = time.monotonic() + 10  # heartbeats carry the counters
    while time.monotonic() < deadline and all_tier_hits(server) - hits_before < NUM_PROMPT_BLOCKS:
        time.sleep(0.1)
    assert all_tier_hits(server) - hits_before >= NUM_PROMPT_BLOCKS  # not recomputed


def test_a_drained_workers_stream_moves_with_its_kv_through_the_tier(tier_server):
    """`workers drain --deadline 0`: the stream moves to the other worker at once, which
    loads its blocks from the tier (only the last partial block is computed again)."""
    from zeroserve.cli.admin_client import AdminClient

    server, tier = tier_server
    body = BODIES["greedy"]
    expected = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body},
                          timeout=120).json()["choices"][0]["text"]
    restart_all(server, tier)
    drained, other = stream_and_freeze(server, body)
    thread, result = drained.pop("stream")
    wait_for_prompt_blocks(tier)
    hits_before = tier_hits(server, other)
    admin = AdminClient(server.url)
    admin.drain(drained["worker_id"], 0)  # the stream moves while its worker is still frozen
    os.kill(drained["pid"], signal.SIGCONT)
    try:
        thread.join(timeout=120)
    finally:
        admin.undrain(drained["worker_id"])
    assert result.exception is None and result.error is None, result.error
    assert result.text == expected
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and tier_hits(server, other) - hits_before < NUM_PROMPT_BLOCKS:
        time.sleep(0.1)
    assert tier_hits(server, other) - hits_before >= NUM_PROMPT_BLOCKS
