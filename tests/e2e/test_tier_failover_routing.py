"""Real workers and the box's KV tier, as the gateway routes (issue 37): `serve --workers 2`
on a tiny real model with the tier on. Both workers' HELLOs name one tier. A worker SIGKILLed
mid-stream is taken out of routing as soon as its connection closes, so the stream continues
on the live worker (which loads its prompt from the tier), not on the killed worker's
restarted process seconds later."""

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

PROMPT = "".join(f"Row {i}: a lazy dog sleeps under the quick brown fox. " for i in range(5))
NUM_PROMPT_BLOCKS = len(PROMPT.encode()) // 16
BODY = {"prompt": PROMPT, "max_tokens": 160, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(module_servers, tmp_path_factory):
    model = write_tiny_chat_model(tmp_path_factory.mktemp("model"), seed=5)
    tier = tmp_path_factory.mktemp("tier") / "kv"
    return module_servers(args=(
        "--model", str(model), "--served-model-name", MODEL, "--device", "cpu",
        "--dtype", "float32", "--workers", "2", "--max-model-len", "512",
        "--num-kv-blocks", "256", "--kv-offloading-size", "0.05",
        "--kv-offloading-dir", str(tier),
        # Heartbeats lapse only after a minute: only a closed connection moves a stream early
        # (before it, the stream waited for the killed worker's restart and went back to it).
        "--worker-timeout", "60"), num_workers=2, timeout_s=180,
        env={"ZEROSERVE_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))})


def counter(server, name: str, worker_id: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = re.search(rf'^zeroserve:{name}_total\{{[^}}]*worker_id="{worker_id}"[^}}]*\}}'
                      r" (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def blocks_not_computed(server, worker_id: str) -> float:
    """Prompt blocks the worker loaded from the tier or found in its own prefix cache (the
    reference request may have run on either worker, so the survivor may hold the prompt
    itself)."""
    return (counter(server, "kv_tier_hits", worker_id)
            + counter(server, "prefix_cache_hits", worker_id) // 16)


def test_both_workers_name_one_tier(server):
    workers = server.workers()
    assert len(workers) == 2
    ids = {w["kv_tier_id"] for w in workers}
    assert len(ids) == 1 and None not in ids, workers


def test_a_killed_workers_stream_continues_on_the_live_worker(server):
    # Computed once first: the tier holds the prompt (and this worker's pool does, so the
    # stream goes there too).
    reference = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **BODY},
                           timeout=120)
    assert reference.status_code == 200, reference.text
    pids = [w["pid"] for w in server.workers()]

    def freeze(num_chunks: int) -> None:  # the tiny model would finish before a kill
        if num_chunks == 20:
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)

    thread, result = stream_in_thread(server.url, BODY, on_chunk=freeze)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(result.chunks) < 20:
        time.sleep(0.01)
    assert len(result.chunks) >= 20, result.error
    victim = next(w for w in server.workers() if w["num_in_flight"])
    survivor = next(w for w in server.workers() if w["worker_id"] != victim["worker_id"])
    os.kill(survivor["pid"], signal.SIGCONT)
    before = blocks_not_computed(server, survivor["worker_id"])
    os.kill(victim["pid"], signal.SIGKILL)
    thread.join(timeout=120)

    assert result.exception is None and result.error is None, result.error
    assert result.text == reference.json()["choices"][0]["text"]
    assert "exited (its connection closed)" in server.log_tail(2000)
    # It went on on the survivor, which did not compute the prompt again: it loaded it from
    # the tier (or held it already, where the reference ran there).
    deadline = time.monotonic() + 10  # heartbeats carry the counters
    while time.monotonic() < deadline and \
            blocks_not_computed(server, survivor["worker_id"]) - before < NUM_PROMPT_BLOCKS:
        time.sleep(0.1)
    assert blocks_not_computed(server, survivor["worker_id"]) - before >= NUM_PROMPT_BLOCKS
