"""Backpressure end to end, with real processes and sockets (the fake backend: no model needed).

What a user notices: a vanished client frees its KV cache at once; a client that stops reading
is paused (it costs nothing but its blocks), everyone else keeps their pace, and after the
slow-client timeout it is cut off and its blocks come back.
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.helpers import NonReadingClient, is_idle, stream_completion

pytestmark = pytest.mark.slow

# The stalled test checks the paused stream (settled for 0.6 s, a stream beside it, the
# next heartbeat) before this cuts it off: 5 s left a loaded machine about a second to spare.
SLOW_CLIENT_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def server(module_servers):
    return module_servers(args=(
        "--backend", "fake", "--device", "cpu", "--num-kv-blocks", "4096",
        "--max-model-len", "60000", "--fake-forward-ms", "1",
        "--slow-client-timeout", str(SLOW_CLIENT_TIMEOUT_S),
        "--max-tokens-limit", "60000",  # streams long enough to hang up on or stall
    ))


def test_client_disconnect_frees_blocks_at_once(server):
    server.wait_for(is_idle, timeout_s=5, what="idle before the test")

    def before_hanging_up(num_chunks: int) -> None:
        if num_chunks == 20:  # /health must show the stream holding blocks first
            server.wait_for(lambda ws: not is_idle(ws), timeout_s=5, what="stream seen busy")

    result = stream_completion(server.url, {"prompt": "Tell me everything.", "max_tokens": 50000},
                               stop_after=20, on_chunk=before_hanging_up)
    assert len(result.chunks) == 20 and not result.is_done  # hung up mid-stream
    # The ABORT frees them within a step (/health shows them at the next heartbeat, every
    # 0.5 s); nothing else would before the slow-client timeout. The deadline is generous for
    # a loaded machine and still ends before that timeout could have freed them.
    server.wait_for(is_idle, timeout_s=SLOW_CLIENT_TIMEOUT_S - 1,
                    what="blocks back after a disconnect")


def settled_free_blocks(server, stable_s: float, timeout_s: float) -> int:
    """The worker's free KV blocks once its one stream is paused and the count has held
    still for `stable_s`."""
    deadline = time.monotonic() + timeout_s
    last, since = None, 0.0
    while time.monotonic() < deadline:
        (worker,) = server.workers()
        if worker["num_paused"] == 1 and worker["num_running"] == 0:
            if worker["num_free_blocks"] != last:
                last, since = worker["num_free_blocks"], time.monotonic()
            elif time.monotonic() - since >= stable_s:
                return last
        else:
            last = None
        time.sleep(0.05)
    raise AssertionError("the stalled stream never paused and held still")


def test_stalled_client_pauses_alone_and_is_cut_off(server):
    server.wait_for(is_idle, timeout_s=5, what="idle before the test")
    body = {"prompt": "Count to a million.", "max_tokens": 300}
    alone = stream_completion(server.url, body)
    assert alone.finish_reason == "length"

    # Big chunks (20 logprobs each) fill the socket buffers quickly.
    stalled = NonReadingClient(server.port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say a lot."}], "max_tokens": 50000,
        "logprobs": True, "top_logprobs": 20,
    })
    try:
        # Paused, and settled: credit already on its way when it paused lets it run one
        # more window, so the pool it holds counts once it stopped changing for a heartbeat.
        held = settled_free_blocks(server, stable_s=0.6, timeout_s=40)

        # Others are not slowed by it. (The same text; not necessarily in as many chunks:
        # speculation may yield several tokens a step, more so for a prompt seen before.)
        beside = stream_completion(server.url, body)
        assert beside.finish_reason == "length" and beside.text == alone.text
        assert beside.elapsed_s < 3 * alone.elapsed_s + 1.0  # generous: a loaded machine

        # The paused stream generated (nearly) nothing meanwhile: once the other stream's
        # blocks are back (as of the next heartbeat), the pool is as it was. The kernel may
        # grow the socket buffers a little, which lets at most a window (2 blocks) through.
        window_blocks = 2
        server.wait_for(lambda ws: ws[0]["num_paused"] == 1
                        and held - window_blocks <= ws[0]["num_free_blocks"] <= held,
                        timeout_s=2, what="the paused stream held still")

        # After the slow-client timeout it is aborted and its blocks are freed.
        server.wait_for(is_idle, timeout_s=SLOW_CLIENT_TIMEOUT_S + 5,
                        what="the stalled stream aborted")
        tail = stalled.read_all()
        assert b'"error"' in tail[-2000:]
    finally:
        stalled.close()


def test_many_streams_each_get_every_token(server):
    server.wait_for(is_idle, timeout_s=5, what="idle before the test")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(
            lambda i: stream_completion(server.url, {
                "prompt": f"Stream number {i}.", "max_tokens": 100 + i,
                "stream_options": {"include_usage": True}}),
            range(8)))
    for i, result in enumerate(results):
        assert result.exception is None and result.error is None
        assert result.finish_reason == "length" and result.is_done
        assert result.usage["completion_tokens"] == 100 + i
    server.wait_for(is_idle, timeout_s=3, what="idle after the streams")
