"""The box's KV tier end to end (issue 37): `serve --workers 2 --kv-offloading-size ...` on a
tiny real model (a random 2-layer Llama over bytes), a streamed completion whose worker is
SIGKILLed mid-stream continues on the other worker from the tier, with exactly the tokens of
the undisturbed run, and the surviving worker reports tier hits on /metrics. The same holds
for a drain (at once, or when its deadline passes) and for `zeroserve workers restart`, whose
new process finds the stream's blocks, and its old prefix cache's, in the tier."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from tests.e2e.helpers import MODEL, stream_in_thread
from tests.worker.conftest import write_tiny_chat_model
from zeroserve.cli.harness import REPO_ROOT, child_env, zeroserve_argv
from zeroserve.worker.kv_tier.pool_file import POOL_SUFFIX, is_live

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
    # Each worker's KV pool lives in the tier (on the CPU, by default): the blocks the other
    # worker loads are read out of the killed worker's pool file.
    assert len([p for p in tier.glob("*" + POOL_SUFFIX) if is_live(p)]) == 2
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


def complete(server, body: dict) -> str:
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body},
                          timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def wait_for_tier_hits(server, worker_ids: tuple[str, ...], at_least: float) -> float:
    """Until these workers' tier hits (heartbeats carry them) reach `at_least`; their sum."""
    def hits() -> float:
        return sum(tier_hits(server, w) for w in worker_ids)

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and hits() < at_least:
        time.sleep(0.1)
    return hits()


def workers_cli(server, *args: str) -> subprocess.Popen:
    """`zeroserve workers ARGS --url ...` as an operator on this machine types it (no key:
    the user's admin token); its output (stderr too) on .stdout, line by line."""
    return subprocess.Popen(zeroserve_argv("workers", *args, "--url", server.url),
                            cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def gateway_pid(server) -> int:
    return httpx.get(f"{server.url}/health/live", timeout=10).json()["pid"]


def test_a_stream_past_its_drain_deadline_moves_with_its_kv_through_the_tier(tier_server):
    """`workers drain W --deadline 1`: a stream still running on W when the deadline passes
    is handed to the other worker, which loads its blocks from the tier (not a replay). The
    stream must outlive the deadline, so the gateway is frozen meanwhile: W stops at its
    credit window (the stream paused, its KV kept) until the deadline hands it back."""
    from zeroserve.cli.admin_client import AdminClient

    server, tier = tier_server
    body = BODIES["greedy"]
    expected = complete(server, body)
    restart_all(server, tier)
    drained, other = stream_and_freeze(server, body)
    thread, result = drained.pop("stream")
    wait_for_prompt_blocks(tier)
    hits_before = tier_hits(server, other)
    admin = AdminClient(server.url)
    num_handed_back = server.log_tail(100000).count("drain deadline: handing")
    admin.drain(drained["worker_id"], 1.0)
    gateway = gateway_pid(server)
    os.kill(gateway, signal.SIGSTOP)
    try:
        os.kill(drained["pid"], signal.SIGCONT)  # it reads the DRAIN; the deadline runs
        deadline = time.monotonic() + 60
        while (time.monotonic() < deadline and server.log_tail(100000).count(
                "drain deadline: handing") == num_handed_back):
            time.sleep(0.1)
    finally:
        os.kill(gateway, signal.SIGCONT)
    try:
        thread.join(timeout=120)
    finally:
        admin.undrain(drained["worker_id"])
    assert server.log_tail(100000).count("drain deadline: handing") > num_handed_back
    assert result.exception is None and result.error is None, result.error
    assert result.text == expected
    assert wait_for_tier_hits(server, (other,), hits_before + NUM_PROMPT_BLOCKS) \
        >= hits_before + NUM_PROMPT_BLOCKS


def test_a_restarted_worker_finds_its_stream_in_the_tier(tier_server):
    """`zeroserve workers restart W --deadline 0` of the worker holding a stream, the other
    worker drained so that the stream can only go on on W's new process: the stream gives
    exactly the undisturbed tokens, and W's new process loaded the prompt from the tier."""
    from zeroserve.cli.admin_client import AdminClient

    server, tier = tier_server
    body = BODIES["greedy"]
    expected = complete(server, body)
    restart_all(server, tier)
    held, other = stream_and_freeze(server, body)
    thread, result = held.pop("stream")
    wait_for_prompt_blocks(tier)
    hits_before = tier_hits(server, held["worker_id"])
    admin = AdminClient(server.url)
    admin.drain(other, 600)
    try:
        restart = workers_cli(server, "restart", held["worker_id"], "--deadline", "0",
                              "--timeout", "120")
        said = restart.stdout.readline()
        assert "draining" in said, said  # the gateway has sent the DRAIN: W reads it first
        os.kill(held["pid"], signal.SIGCONT)
        said += restart.communicate(timeout=180)[0]
        assert restart.returncode == 0, said
        thread.join(timeout=120)
    finally:
        admin.undrain(other)
    assert result.exception is None and result.error is None, result.error
    assert result.text == expected
    [restarted] = [w for w in server.workers() if w["worker_id"] == held["worker_id"]]
    assert restarted["pid"] != held["pid"]
    assert wait_for_tier_hits(server, (held["worker_id"],), hits_before + NUM_PROMPT_BLOCKS) \
        >= hits_before + NUM_PROMPT_BLOCKS


def test_a_restarted_worker_finds_its_prefix_cache_in_the_tier(tier_server):
    """A prompt completed on W (in W's prefix cache and the tier), then `workers restart W`:
    the same prompt on W's new process loads the prompt's blocks from the tier."""
    from zeroserve.cli.admin_client import AdminClient

    server, tier = tier_server
    body = BODIES["greedy"]
    restart_all(server, tier)
    admin = AdminClient(server.url)
    admin.drain("worker-1", 600)  # every request goes to worker-0
    try:
        expected = complete(server, body)
        wait_for_prompt_blocks(tier)
        hits_before = tier_hits(server, "worker-0")
        restart = workers_cli(server, "restart", "worker-0", "--deadline", "0",
                              "--timeout", "120")
        said = restart.communicate(timeout=180)[0]
        assert restart.returncode == 0, said
        again = complete(server, body)
    finally:
        admin.undrain("worker-1")
    assert again == expected
    assert wait_for_tier_hits(server, ("worker-0",), hits_before + NUM_PROMPT_BLOCKS) \
        >= hits_before + NUM_PROMPT_BLOCKS
