"""GET /metrics: vLLM's names, counters held to the workload that ran, worker gauges from
heartbeats, failovers, and the API-key rule."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.helpers import GatewayServer, cyclic_reply, wait_until
from tests.gateway.test_real_worker import start_worker
from zeroserve.gateway.observability.metrics import token_buckets
from zeroserve.gateway.text.tokenizer import load_tokenizer

MODEL = "SmolLM2-135M-Instruct"


def scrape(gw, headers=None) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, parsed by prometheus-client's own parser."""
    r = httpx.get(gw.url + "/metrics", headers=headers, timeout=5)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels) -> float:
    labels.setdefault("model_name", MODEL)
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


COUNTED = ["zeroserve:time_to_first_token_seconds_count",
           "zeroserve:e2e_request_latency_seconds_count",
           "zeroserve:request_queue_time_seconds_count",
           "zeroserve:request_prefill_time_seconds_count",
           "zeroserve:request_decode_time_seconds_count",
           "zeroserve:request_prompt_tokens_count",
           "zeroserve:request_generation_tokens_count"]


def test_counters_and_histogram_counts_match_the_workload():
    num_requests, num_tokens, prompt = 5, 7, "hello"  # the byte tokenizer: 5 tokens
    with GatewayServer() as gw:
        worker = gw.worker(reply=cyclic_reply("ab"), tokens_per_step=2).start()
        assert worker.ready.wait(5)
        before = scrape(gw)
        for i in range(num_requests):
            body = {"prompt": prompt, "max_tokens": num_tokens, "stream": i % 2 == 0}
            r = httpx.post(gw.url + "/v1/completions", json=body, timeout=10)
            assert r.status_code == 200
        after = scrape(gw)
        worker.stop()

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("zeroserve:generation_tokens_total") == num_requests * num_tokens
    assert delta("zeroserve:prompt_tokens_total") == num_requests * len(prompt)
    assert delta("zeroserve:request_success_total", finished_reason="length") == num_requests
    for name in COUNTED:
        assert delta(name) == num_requests, name
    assert delta("zeroserve:request_generation_tokens_sum") == num_requests * num_tokens
    # Chunks of 2 tokens: 4 chunks per request, so 3 gaps after the first token.
    assert delta("zeroserve:inter_token_latency_seconds_count") == num_requests * 3
    assert value(after, "zeroserve:request_prompt_tokens_bucket", le="5.0") == num_requests


def test_stop_string_finishes_count_as_stop():
    with GatewayServer() as gw:
        worker = gw.worker(reply=cyclic_reply("abc")).start()
        assert worker.ready.wait(5)
        r = httpx.post(gw.url + "/v1/completions", timeout=10, json={
            "prompt": "x", "max_tokens": 50, "stop": ["c"]})
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        samples = scrape(gw)
        worker.stop()
    assert value(samples, "zeroserve:request_success_total", finished_reason="stop") == 1
    assert value(samples, "zeroserve:e2e_request_latency_seconds_count") == 1


def test_worker_gauges_follow_heartbeats():
    with GatewayServer() as gw:
        worker = gw.worker(worker_id="w0", num_free_blocks=250).start()
        assert worker.ready.wait(5)
        assert wait_until(lambda: value(scrape(gw), "zeroserve:kv_cache_usage_perc",
                                        worker_id="w0") == 0.75)
        samples = scrape(gw)
        assert value(samples, "zeroserve:workers", status="ready") == 1
        assert value(samples, "zeroserve:num_requests_running", worker_id="w0") == 0
        assert ("zeroserve:num_requests_paused", (("model_name", MODEL),
                                                  ("worker_id", "w0"))) in samples
        assert value(samples, "zeroserve:event_loop_lag_seconds", quantile="0.99") >= 0
        assert ("zeroserve:zmq_messages_dropped_total", (("model_name", MODEL),)) in samples
        worker.stop()


def test_a_failover_is_counted_and_tokens_stay_exact():
    with GatewayServer() as gw:
        worker = gw.worker(reply=cyclic_reply("abc"), step_s=0.01).start()
        assert worker.ready.wait(5)
        before = scrape(gw)
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=10, json={
                "prompt": "x", "max_tokens": 300, "stream": True}) as r:
            lines = r.iter_lines()
            next(x for x in lines if x.startswith("data: {"))
            worker.stop()  # the process dies ...
            worker2 = gw.worker(reply=cyclic_reply("abc")).start()  # ... and comes back
            rest = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
        after = scrape(gw)
        worker2.stop()

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("zeroserve:failovers_total") == 1
    assert delta("zeroserve:worker_events_total", worker_id="fake-0", event="restarted") == 1
    assert delta("zeroserve:generation_tokens_total") == 300  # across both workers
    assert delta("zeroserve:request_generation_tokens_sum") == 300
    assert delta("zeroserve:time_to_first_token_seconds_count") == 1
    assert delta("zeroserve:e2e_request_latency_seconds_count") == 1
    assert delta("zeroserve:request_queue_time_seconds_count") == 1


def test_metrics_need_the_api_key_when_keys_are_set():
    with GatewayServer(api_keys=("sk-metrics",)) as gw:
        assert httpx.get(gw.url + "/metrics").status_code == 401
        samples = scrape(gw, headers={"Authorization": "Bearer sk-metrics"})
        assert ("zeroserve:generation_tokens_total", (("model_name", MODEL),)) in samples


def test_two_apps_in_one_process_keep_their_own_figures():
    with GatewayServer() as a, GatewayServer() as b:
        worker = a.worker().start()
        assert worker.ready.wait(5)
        assert httpx.post(a.url + "/v1/completions", json={"prompt": "x"}).status_code == 200
        assert value(scrape(a), "zeroserve:e2e_request_latency_seconds_count") == 1
        assert value(scrape(b), "zeroserve:e2e_request_latency_seconds_count") == 0
        worker.stop()


def test_token_buckets_are_1_2_5():
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


def test_429s_are_counted_by_reason():
    # The first request still queued and the bucket not refilled when the others come, however
    # slow a loaded machine is between them (it was a 1 s queue timeout and 1 request/s).
    with GatewayServer(max_queued_requests=1, queue_timeout_s=5, rate_limit_rps=0.05,
                       rate_limit_burst=2) as gw, httpx.Client() as c:
        import threading
        first = threading.Thread(target=lambda: c.post(
            gw.url + "/v1/completions", json={"prompt": "x"}, timeout=10))
        first.start()  # no worker: it waits in the queue
        assert wait_until(lambda: gw.gateway.admission.num_queued == 1)
        assert httpx.post(gw.url + "/v1/completions", json={"prompt": "y"}).status_code == 429
        # The bucket (2) is spent: the next one is refused by the rate limiter.
        assert httpx.get(gw.url + "/v1/models").status_code == 429
        first.join()
        samples = scrape(gw)  # /metrics is not rate limited
    assert value(samples, "zeroserve:request_rejected_total", reason="queue_full") == 1
    assert value(samples, "zeroserve:request_rejected_total",
                 reason="rate_limit_exceeded") == 1


def test_a_client_that_disconnects_mid_stream_is_counted():
    with GatewayServer() as gw:
        worker = gw.worker(reply=cyclic_reply("abc"), step_s=0.01).start()
        assert worker.ready.wait(5)
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=10, json={
                "prompt": "x", "max_tokens": 1000, "stream": True}) as r:
            next(x for x in r.iter_lines() if x.startswith("data: {"))
        # Closed mid-stream: the gateway sees the disconnect.
        assert wait_until(lambda: value(scrape(gw), "zeroserve:request_aborted_total",
                                        reason="disconnect") == 1)
        samples = scrape(gw)
        assert value(samples, "zeroserve:request_aborted_total", reason="slow_client") == 0
        assert value(samples, "zeroserve:e2e_request_latency_seconds_count") == 0
        worker.stop()


def test_worker_counters_stay_monotonic_across_a_restart():
    """Heartbeat counters are per process: a restarted worker counts from 0 again, and the
    gateway's totals keep what the old process counted."""
    name = "zeroserve:prefix_cache_hits_total"
    with GatewayServer() as gw:
        w1 = gw.worker(worker_id="w0", counters={"prefix_cache_hits": 10,
                                                 "num_preemptions": 1}).start()
        assert w1.ready.wait(5)
        assert wait_until(lambda: value(scrape(gw), name, worker_id="w0") == 10)
        w1.counters = {"prefix_cache_hits": 15, "num_preemptions": 1}
        assert wait_until(lambda: value(scrape(gw), name, worker_id="w0") == 15)
        w1.stop()
        w2 = gw.worker(worker_id="w0", counters={"prefix_cache_hits": 3}).start()
        assert w2.ready.wait(5)
        assert wait_until(lambda: value(scrape(gw), name, worker_id="w0") == 18)
        samples = scrape(gw)
        w2.stop()
    assert value(samples, "zeroserve:num_preemptions_total", worker_id="w0") == 1


@pytest.mark.slow
def test_worker_figures_match_ground_truth_across_a_worker_restart():
    """A real worker process (fake backend): prefix-cache queries and hits equal what the
    responses' usage says, the phase histograms count every request, and a killed and
    restarted worker's figures add to the totals instead of resetting them."""
    tokenizer = load_tokenizer("default")
    prompt = "The same long system prompt, shared by every request of this test. " * 3
    num_prompt, num_cached, num_requests = 0, 0, 0
    with GatewayServer(tokenizer, worker_timeout_s=1.0) as gw:
        for _incarnation in range(2):
            proc = start_worker(gw, "real-0")
            try:
                assert wait_until(lambda: httpx.get(gw.url + "/health").status_code == 200, 60)
                for i in range(3):
                    r = httpx.post(gw.url + "/v1/completions", timeout=30, json={
                        "prompt": prompt + str(i), "max_tokens": 5, "ignore_eos": True})
                    usage = r.json()["usage"]
                    num_prompt += usage["prompt_tokens"]
                    num_cached += usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                    num_requests += 1
                assert num_cached > 0
                expected = num_prompt
                assert wait_until(lambda: value(scrape(gw), "zeroserve:prefix_cache_queries_total",
                                                worker_id="real-0") == expected, 10)  # noqa: B023
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        samples = scrape(gw)
    assert value(samples, "zeroserve:prefix_cache_hits_total", worker_id="real-0") == num_cached
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert value(samples, f"zeroserve:{name}_count") == num_requests, name
    # The worker's phases: a 5 ms fake forward per step, 4 decode steps after the first token.
    assert value(samples, "zeroserve:request_decode_time_seconds_sum") >= num_requests * 0.015
    assert 0 < value(samples, "zeroserve:request_prefill_time_seconds_sum") < num_requests * 5


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed "
                    "(Debian's prometheus package)")
def test_promtool_accepts_the_exposition():
    """`promtool check metrics` finds nothing wrong but the colon in vLLM-style names (its
    linter reserves colons for recording rules; vLLM's own names draw the same remark)."""
    with GatewayServer() as gw:
        worker = gw.worker(reply=cyclic_reply("ab"), counters={"prefix_cache_hits": 2}).start()
        assert worker.ready.wait(5)
        assert httpx.post(gw.url + "/v1/completions", timeout=10,
                          json={"prompt": "hi", "max_tokens": 4}).status_code == 200
        assert wait_until(lambda: value(scrape(gw), "zeroserve:prefix_cache_hits_total",
                                        worker_id="fake-0") == 2)
        body = httpx.get(gw.url + "/metrics").text
        worker.stop()
    check = subprocess.run(["promtool", "check", "metrics"], input=body, text=True,
                           capture_output=True, timeout=30)
    problems = [line for line in (check.stdout + check.stderr).splitlines()
                if line.strip() and "metric names should not contain ':'" not in line]
    assert problems == []


def test_speculative_decoding_counters_come_from_heartbeats():
    """A worker's speculative-decoding counters (worker/speculative.py's heartbeat names)
    show as vLLM's spec_decode families, the per-position one labelled by position."""
    from zeroserve.worker.speculative import SpecDecodeStats, spec_decode_counters

    stats = SpecDecodeStats()
    for num_drafts, num_accepted in ((4, 4), (4, 1), (3, 0)):
        stats.record(num_drafts, num_accepted)
    with GatewayServer() as gw:
        worker = gw.worker(worker_id="w0", counters=spec_decode_counters(stats)).start()
        assert worker.ready.wait(5)
        name = "zeroserve:spec_decode_num_drafts_total"
        assert wait_until(lambda: value(scrape(gw), name, worker_id="w0") == 3)
        samples = scrape(gw)
        worker.stop()
    assert value(samples, "zeroserve:spec_decode_num_draft_tokens_total", worker_id="w0") == 11
    assert value(samples, "zeroserve:spec_decode_num_accepted_tokens_total",
                 worker_id="w0") == 5
    per_pos = [value(samples, "zeroserve:spec_decode_num_accepted_tokens_per_pos_total",
                     worker_id="w0", position=str(i)) for i in range(4)]
    assert per_pos == [2, 1, 1, 1]
