"""Smoke tests of the serving benchmark against an in-test fake OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time

import pytest

pytest.importorskip("aiohttp")
uvicorn = pytest.importorskip("uvicorn")
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import JSONResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from benchmarks.bench_data import ChatSample, iter_conversations  # noqa: E402
from benchmarks.bench_serving import BenchConfig, percentile_stats, run  # noqa: E402
from zeroserve.cli.harness import free_port  # noqa: E402

FIRST_TOKEN_S = 0.05
TOKEN_GAP_S = 0.01


class FakeServer:
    """Streams `max_tokens` one-token chunks: the first after FIRST_TOKEN_S, then every
    TOKEN_GAP_S. `short_by` tokens are dropped (a server ignoring ignore_eos); every
    `fail_every`-th request gets a 500."""

    def __init__(self, short_by: int = 0, fail_every: int = 0, send_usage: bool = True):
        self.short_by, self.fail_every, self.send_usage = short_by, fail_every, send_usage
        self.num_requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []
        # What it did, by its own clock (a loaded machine's timers fire late): ms from each
        # request to its first token, and between a request's tokens.
        self.first_token_ms: list[float] = []
        self.token_gaps_ms: list[float] = []
        app = Starlette(routes=[
            Route("/v1/models", self.models),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ])
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started:
            assert time.time() < deadline, "fake server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def chat(self, request):
        arrived = time.monotonic()
        body = await request.json()
        self.bodies.append(body)
        self.num_requests += 1
        if self.fail_every and self.num_requests % self.fail_every == 0:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        n = max(1, body["max_tokens"] - self.short_by)

        async def events():
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                head = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                yield f"data: {json.dumps(head)}\n\n"
                await asyncio.sleep(FIRST_TOKEN_S)
                last = arrived
                for i in range(n):
                    if i:
                        await asyncio.sleep(TOKEN_GAP_S)
                    now = time.monotonic()
                    (self.token_gaps_ms if i else self.first_token_ms).append(
                        (now - last) * 1000)
                    last = now
                    chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "},
                                          "finish_reason": "length" if i == n - 1 else None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if self.send_usage:
                    usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


SAMPLES = [ChatSample([{"role": "user", "content": f"question {i}"}], 3, 20) for i in range(4)]


def config(url: str, **kw) -> BenchConfig:
    base = dict(base_url=url, num_prompts=8, concurrency=4, output_len=6, num_warmup=1,
                show_progress=False)
    base.update(kw)
    return BenchConfig(**base)


def test_closed_loop_measures_what_the_server_does():
    with FakeServer() as srv:
        s = run(config(srv.url, slo_ttft_ms=30_000, slo_tpot_ms=30_000), SAMPLES)
    assert s["model"] == "fake-model"
    assert (s["completed"], s["failed"], s["token_mismatches"]) == (8, 0, 0)
    assert srv.max_in_flight == 4  # the closed loop keeps exactly `concurrency` in flight
    assert s["total_output_tokens"] == 8 * 6
    # The fake's timing shows through: first token after ~50 ms, then 10 ms apart, or what
    # the server did instead by its own clock (its sleeps run late on a loaded machine).
    server_ttft = statistics.median(srv.first_token_ms)
    server_gap = statistics.median(srv.token_gaps_ms)
    assert FIRST_TOKEN_S * 1000 <= s["ttft_ms"]["p50"] < max(FIRST_TOKEN_S * 1000,
                                                              server_ttft) + 150
    assert TOKEN_GAP_S * 1000 * 0.8 <= s["itl_ms"]["p50"] < max(TOKEN_GAP_S * 1000,
                                                                 server_gap) + 40
    assert TOKEN_GAP_S * 1000 * 0.8 <= s["tpot_ms"]["mean"] < max(
        TOKEN_GAP_S * 1000, statistics.mean(srv.token_gaps_ms)) + 40
    assert len(s["itl_samples_ms"]) == 8 * 5
    assert s["e2e_ms"]["p50"] >= s["ttft_ms"]["p50"] + 5 * TOKEN_GAP_S * 1000 * 0.8
    assert s["output_throughput"] == pytest.approx(48 / s["duration_s"])
    assert s["goodput"] == pytest.approx(s["request_throughput"])
    body = srv.bodies[-1]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 6
    assert body["messages"][0]["role"] == "user"


def test_short_outputs_errors_and_tight_slo_are_counted():
    with FakeServer(short_by=2, fail_every=3) as srv:
        s = run(config(srv.url, num_warmup=0, slo_ttft_ms=1.0), SAMPLES)
    assert s["failed"] == 2 and s["completed"] == 6
    assert s["error_examples"] and "HTTP 500" in s["error_examples"][0]
    assert s["token_mismatches"] == 6
    assert s["token_mismatch_examples"][0] == {"expected": 6, "got": 4, "finish_reason": "length"}
    assert s["goodput"] == 0.0  # no request got its first token within 1 ms


def test_open_loop_and_missing_usage():
    with FakeServer(send_usage=False) as srv:
        s = run(config(srv.url, concurrency=None, request_rate=200.0, num_prompts=6), SAMPLES)
    assert s["mode"] == "open" and s["completed"] == 6
    assert s["usage_missing"] == 6 and s["token_mismatches"] == 0
    assert s["total_output_tokens"] == 6 * 6  # counted from chunks instead
    assert srv.max_in_flight > 1  # arrivals do not wait for earlier requests


def test_truncated_dataset_keeps_complete_records(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n {"id": "a", "conversations": []},\n {"id": "b", "x": [1, 2]},\n {"id": "c", "conv')
    assert [c["id"] for c in iter_conversations(path)] == ["a", "b"]


def test_percentiles_match_linear_interpolation():
    st = percentile_stats([1.0, 2.0, 3.0, 4.0], scale=1.0)
    assert st["mean"] == 2.5 and st["p50"] == 2.5
    assert st["p90"] == pytest.approx(3.7) and st["p99"] == pytest.approx(3.97)


@pytest.mark.slow
def test_hf_server_generates_exactly_the_requested_tokens(tmp_path):
    """The transformers baseline batches concurrent requests and honours ignore_eos."""
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    from tests.worker.conftest import write_tiny_chat_model

    root = Path(__file__).resolve().parents[2]
    port = free_port()
    log = open(tmp_path / "hf.log", "wb")  # noqa: SIM115
    # A tiny HF model folder (the default model's GGUF takes most of a minute to dequantize).
    model = write_tiny_chat_model(tmp_path / "model")
    proc = subprocess.Popen([sys.executable, str(root / "benchmarks" / "hf_server.py"), "--port",
                             str(port), "--batch-window-ms", "200", "--model", str(model)],
                            cwd=root, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "hf.log").read_text()[-2000:]
            assert time.time() < deadline, "hf_server did not start"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                time.sleep(1)
        s = run(config(f"http://127.0.0.1:{port}", num_prompts=3, concurrency=3, output_len=5),
                SAMPLES)
        assert (s["completed"], s["failed"], s["token_mismatches"]) == (3, 0, 0)
        assert s["total_output_tokens"] == 15
        # A content-parts message (as vLLM's client sends) works too.
        body = json.dumps({"model": "m", "max_completion_tokens": 3, "ignore_eos": True,
                           "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     data=body.encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            out = json.loads(resp.read())
        assert out["usage"]["completion_tokens"] == 3
        assert out["choices"][0]["finish_reason"] == "length"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _fake_run(system: str, level: str, conc: int, tput: float, ttft: float) -> dict:
    stats = {"mean": ttft, "p50": ttft, "p90": ttft, "p99": ttft}
    return {"system": system, "level": level, "completed": 4, "failed": 0,
            "token_mismatches": 0, "config": {"concurrency": conc, "request_rate": None},
            "output_throughput": tput, "request_throughput": 1.0, "goodput": None,
            "ttft_ms": stats, "tpot_ms": stats, "itl_ms": stats, "e2e_ms": stats,
            "itl_samples_ms": [1.0, 2.0]}


def test_compare_takes_medians_and_rewrites_only_its_docs_section(tmp_path):
    from benchmarks import compare

    plan, _ = compare.parse_args(["--quick", "--systems", "zeroserve,llama-server",
                                  "--concurrency", "16"])
    runs = []
    for repeat, (ours, theirs) in enumerate([(300.0, 100.0), (100.0, 50.0), (200.0, 100.0)]):
        runs.append({**_fake_run("zeroserve", "c16", 16, ours, 100.0), "repeat": repeat})
        runs.append({**_fake_run("llama-server", "c16", 16, theirs, 400.0), "repeat": repeat})
    table = compare.aggregate(runs)
    assert table[("zeroserve", "c16")]["output_throughput"] == 200.0  # the median of 3
    assert table[("zeroserve", "c16")]["completed"] == 12
    section = compare.markdown(plan, table, "python benchmarks/compare.py --quick", "now",
                               (1.0, 1.0, 1.0), runs=runs)
    assert "| zeroserve | c16 | 12 / 0 | 0 | 200.0 (100.0-300.0) |" in section
    # Ratios pair the systems inside each repeat (3x, 2x, 2x), not medians with medians.
    assert "zeroserve / llama-server at c16: throughput 2.00x (2.00-3.00)" in section
    page = tmp_path / "benchmarks.md"
    begin, end = compare.markers()
    page.write_text("# Benchmarks\n\nintro\n\n" + begin + "\nold\n" + end + "\n\n## After\n")
    compare.write_docs(section, page)
    compare.write_docs(section, page)  # a rerun replaces, never appends
    text = page.read_text()
    assert text.count(begin) == 1 and "old" not in text
    assert text.startswith("# Benchmarks\n\nintro") and text.endswith("## After\n")
    # A named section lives beside the default one; rerunning it replaces only itself.
    named = compare.markdown(plan, table, "cmd", "now", (1.0, 1.0, 1.0), section="sampled")
    compare.write_docs(named, page, "sampled")
    compare.write_docs(named.replace("12 / 0", "13 / 0"), page, "sampled")
    text = page.read_text()
    assert text.count(begin) == 1 and text.count(compare.markers("sampled")[0]) == 1
    assert "| zeroserve | c16 | 13 / 0 |" in text and "| zeroserve | c16 | 12 / 0 |" in text
