"""Prometheus metrics for `GET /metrics`: vLLM's names with the `zeroserve:` prefix.

Two kinds, so that counters never go backwards:

- **Request figures** are counted here, in the gateway, from the streams it serves
  (`RequestMetrics`): token counters, finishes by reason, failovers, 429s and client-side
  aborts by reason, worker restarts and losses, and the latency and size histograms. A
  worker that restarts or a stream that moves to another worker changes nothing in them;
  after N requests of M tokens `generation_tokens` has grown by N x M. The generation group
  calls `on_*` at the points a request is admitted, gets its first output and finishes; per
  chunk of output it costs one list append (`record_gap`), per batch of updates one count.
- **Worker figures**: gauges (running, waiting, paused, KV use; workers by status) and
  gateway internals (event-loop lag, messages dropped) are read when scraped
  (`GatewayCollector`) from the state the gateway already keeps; the workers' cumulative
  counters (prefix cache, preemptions) come in heartbeats and are added up per worker with
  a new baseline for each new process (`on_worker_counters`).

`inter_token_latency_seconds` is the gap between two chunks of one stream as the gateway
receives them (one worker step's tokens come together), not per token as vLLM's.
Each app has its own `CollectorRegistry`, so several apps in one process do not clash.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from zeroserve.common.protocol import COUNTER_NAMES, SPEC_DECODE_PER_POS_COUNTER
from zeroserve.gateway.errors import APIError
from zeroserve.gateway.observability.fairness_metrics import FairnessCollector
from zeroserve.gateway.observability.loop_monitor import LoopLagMonitor
from zeroserve.gateway.observability.tier_metrics import WRITE_INTERVAL_S, TierMetrics
from zeroserve.gateway.workers.handle import WorkerHandle, WorkerStatus


class _Workers(Protocol):
    workers: Mapping[str, WorkerHandle]


class _Queue(Protocol):
    num_queued: int
    stats: Any

    def shares(self) -> dict[str, float]: ...


class _Edge(Protocol):
    num_dropped: int
    num_receive_restarts: int


class GatewayState(Protocol):
    """What a scrape reads of the gateway (gateway/core.py's Gateway): its workers, its
    queue and its ZeroMQ edge."""

    registry: _Workers
    admission: _Queue
    edge: _Edge

PREFIX = "zeroserve:"
# The HELP text of each Heartbeat.counters name (common/protocol.py's COUNTER_NAMES).
_WORKER_COUNTER_DOCS = {
    "prefix_cache_queries": "Prompt tokens looked up in a worker's prefix cache (at each "
                            "request's first admission).",
    "prefix_cache_hits": "Prompt tokens found in a worker's prefix cache.",
    "num_preemptions": "Sequences a worker preempted (recompute) for want of KV blocks, or "
                       "for their batch slot (a better class's, or a key holding fewer).",
    "spec_decode_num_drafts": "Speculative proposals a worker verified.",
    "spec_decode_num_draft_tokens": "Draft tokens of the verified speculative proposals.",
    "spec_decode_num_accepted_tokens": "Draft tokens the model accepted.",
    "kv_tier_hits": "KV blocks a worker loaded from the box's KV tier instead of computing.",
    "kv_tier_misses": "Admissions whose next KV block the box's KV tier did not hold (or "
                      "held damaged): computed from there.",
    "kv_tier_read_bytes": "Bytes of KV blocks a worker read from the box's KV tier.",
    "kv_tier_written_bytes": "Bytes of KV blocks a worker wrote to the box's KV tier.",
    "kv_tier_evictions": "KV blocks a worker evicted from the box's KV tier to keep its bound.",
    "kv_tier_load_microseconds": "Time a worker spent reading and verifying KV tier blocks.",
}
# The worker counters of accepted drafts per position (common/protocol.py), as one family
# labelled by position, vLLM's spec_decode_num_accepted_tokens_per_pos.
MAX_SPEC_POSITIONS = 16
ITL_BATCH = 4096  # inter-chunk gaps kept before they are bucketed (at the latest: a scrape)
# The size histograms' top bucket when the model files do not say the context length.
DEFAULT_MAX_MODEL_LEN = 131072

# vLLM's buckets (vllm/v1/metrics/loggers.py, as of v0.8-0.10).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


class LoopHistogram:
    """A histogram for the request path, without prometheus-client's lock and label
    machinery: a bucket index by bisection and an increment (about a quarter of the cost).
    Only the event loop's thread touches it, the scrape included, so it needs no lock."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]):
        self.name, self.doc, self.bounds = name, doc, bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0
        self._bounds_array = np.asarray(bounds, dtype=np.float64)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_many(self, values: list[float]) -> None:
        if not values:
            return
        array = np.asarray(values, dtype=np.float64)
        indexes = np.searchsorted(self._bounds_array, array, side="left")
        for i, count in enumerate(np.bincount(indexes, minlength=len(self.counts)).tolist()):
            self.counts[i] += count
        self.sum += float(array.sum())

    def family(self, model_name: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        buckets, total = [], 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            total += count
            buckets.append((floatToGoString(bound), total))
        buckets.append(("+Inf", total + self.counts[-1]))
        family.add_metric([model_name], buckets, self.sum)
        return family


class RequestMetrics:
    """Counters and histograms fed by the gateway's request path."""

    def __init__(self, registry: CollectorRegistry, model_name: str,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN):
        label = ["model_name"]

        def counter(name: str, doc: str, labels: list[str] = label) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        self._histograms: list[LoopHistogram] = []

        def histogram(name: str, doc: str, buckets) -> LoopHistogram:
            h = LoopHistogram(PREFIX + name, doc, tuple(buckets))
            self._histograms.append(h)
            return h

        m = model_name
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.").labels(m)
        # Counted per batch of updates, so a plain number (exposed by collect_loop_owned).
        self.num_generation_tokens = 0
        self.ttft = histogram("time_to_first_token_seconds",
                              "From arrival to the first output token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Gap between two output chunks of a stream.", ITL_BUCKETS)
        # The gap between two chunks of a stream, the one per-chunk call: a bare list append
        # (a builtin, no Python frame); bucketed in bulk by numpy, at the latest at a scrape.
        self._itl_pending: list[float] = []
        self.record_gap: Callable[[float], None] = self._itl_pending.append
        self._success = counter("request_success", "Requests finished, by finish reason.",
                                ["model_name", "finished_reason"])
        self._success_by_reason = {r: self._success.labels(m, r) for r in ("stop", "length")}
        self._rejected = counter("request_rejected", "Requests refused with 429, by reason.",
                                 ["model_name", "reason"])
        self._rejected_by_reason = {r: self._rejected.labels(m, r)
                                    for r in ("queue_full", "rate_limit_exceeded")}
        self._aborted = counter("request_aborted", "HTTP requests ended by the client's "
                                "side: it disconnected, or read too slowly.",
                                ["model_name", "reason"])
        self._aborted_by_reason = {r: self._aborted.labels(m, r)
                                   for r in ("disconnect", "slow_client")}
        self._worker_events = counter("worker_events", "Worker restarts (a HELLO replacing a "
                                      "live incarnation), losses (no heartbeat) and exits "
                                      "(its supervisor reaped the process).",
                                      ["model_name", "worker_id", "event"])
        # Generation requests by the API they came through (completions, chat, responses,
        # messages): all share one pipeline, so the figures above cover them all.
        self._by_endpoint = counter("api_requests", "Generation requests admitted to the "
                                    "pipeline, by API endpoint.", ["model_name", "endpoint"])
        # Engine requests by the served model and version whose worker took them first
        # (an alias's split, a canary's share).
        self._routed = counter("model_requests", "Engine requests sent to a worker for the "
                               "first time, by served model and version.",
                               ["model_name", "version"])
        self.failovers = counter("failovers", "Streams with output moved to another "
                                 "worker.").labels(m)
        self.stale_outputs = counter(
            "stale_outputs_dropped", "Worker outputs dropped because they belong to an "
            "attempt of a stream other than its current one (sent before it moved).").labels(m)
        self.e2e = histogram("e2e_request_latency_seconds", "From arrival to the finish.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Waiting before the first scheduling: in the "
            "gateway's queue, then in the worker's.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "From the first scheduling on a worker to the "
            "first output token (the worker's measure).", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram(
            "request_decode_time_seconds", "From the first output token to the finish.",
            REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram(
            "request_inference_time_seconds", "Prefill plus decode time.",
            REQUEST_LATENCY_BUCKETS)
        # Worker counters (from heartbeats), kept monotonic here across worker restarts.
        self._worker_counters = {
            name: counter(name, _WORKER_COUNTER_DOCS[name], ["model_name", "worker_id"])
            for name in COUNTER_NAMES}
        self._last_counters: dict[str, tuple[bytes, dict[str, int]]] = {}
        self._spec_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens the model accepted, by "
            "their position in the proposal (0 first).", ["model_name", "worker_id", "position"])
        sizes = token_buckets(max_model_len)
        self.prompt_size = histogram("request_prompt_tokens", "Prompt tokens per request.",
                                     sizes)
        self.generation_size = histogram("request_generation_tokens",
                                         "Output tokens per finished request.", sizes)
        self.model_name = m
        registry.register(_LoopCollector(self))

    # --- the request path's calls ------------------------------------------------------

    def on_api_request(self, endpoint: str) -> None:
        """A generation request arrived through this API (its prompt was checked)."""
        self._by_endpoint.labels(self.model_name, endpoint).inc()

    def on_admitted(self, num_prompt_tokens: int) -> None:
        """One engine request was sent to a worker for the first time."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prompt_size.observe(num_prompt_tokens)

    def on_first_token(self, ttft_s: float, queue_s: float, prefill_s: float) -> None:
        """A request's first output token arrived: its queue and prefill phases are known."""
        self.ttft.observe(ttft_s)
        self.queue_time.observe(queue_s)
        self.prefill_time.observe(prefill_s)

    def on_tokens(self, num_tokens: int) -> None:
        """Output tokens of one batch of updates (many streams' chunks): counted once."""
        self.num_generation_tokens += num_tokens
        if len(self._itl_pending) >= ITL_BATCH:
            self._flush_gaps()

    def _flush_gaps(self) -> None:
        self.itl.observe_many(self._itl_pending)
        self._itl_pending.clear()

    def collect_loop_owned(self) -> Iterator[Metric]:
        """The figures kept as plain numbers on the event loop (the scrape runs there too)."""
        self._flush_gaps()
        tokens = CounterMetricFamily(PREFIX + "generation_tokens",
                                     "Output tokens received from workers.",
                                     labels=["model_name"])
        tokens.add_metric([self.model_name], self.num_generation_tokens)
        yield tokens
        for histogram in self._histograms:
            yield histogram.family(self.model_name)

    def on_finished(self, finish_reason: str, num_output_tokens: int, e2e_s: float,
                    prefill_s: float | None = None, decode_s: float | None = None) -> None:
        """A request finished; `prefill_s`/`decode_s` are None if it never had output."""
        success = self._success_by_reason.get(finish_reason)
        if success is None:
            success = self._success_by_reason[finish_reason] = self._success.labels(
                self.model_name, finish_reason)
        success.inc()
        self.e2e.observe(e2e_s)
        self.generation_size.observe(num_output_tokens)
        if decode_s is not None:
            self.decode_time.observe(decode_s)
            self.inference_time.observe((prefill_s or 0.0) + decode_s)

    def on_worker_counters(self, worker_id: str, route: bytes, counters: dict[str, int]) -> None:
        """A heartbeat's cumulative counters. Each worker process counts from 0, so a new
        route (a restart) starts a new baseline: our totals only ever grow."""
        last = self._last_counters.get(worker_id)
        previous = last[1] if last is not None and last[0] == route else {}
        for name, family in self._worker_counters.items():
            value = counters.get(name)
            if value is None:
                continue
            before = previous.get(name, 0)
            delta = value - before if value >= before else value
            child = family.labels(self.model_name, worker_id)  # exposed from the first beat
            if delta:
                child.inc(delta)
        for name, value in counters.items():
            position = name.removeprefix(SPEC_DECODE_PER_POS_COUNTER)
            if position == name or not position.isdigit() or \
                    int(position) >= MAX_SPEC_POSITIONS:
                continue
            before = previous.get(name, 0)
            delta = value - before if value >= before else value
            if delta:
                self._spec_per_pos.labels(self.model_name, worker_id, position).inc(delta)
        self._last_counters[worker_id] = (route, dict(counters))

    def on_routed(self, model: str, version: str) -> None:
        """An engine request went to a worker of this model and version (its first SUBMIT)."""
        self._routed.labels(model, version).inc()

    def on_failover(self) -> None:
        self.failovers.inc()

    def on_stale_output(self) -> None:
        self.stale_outputs.inc()

    def on_aborted(self, reason: str) -> None:
        """The client's side ended an HTTP request: "disconnect" or "slow_client"."""
        self._aborted_by_reason[reason].inc()

    def on_worker_event(self, worker_id: str, event: str) -> None:
        """A worker "restarted" or was "lost" (rare: a label lookup each time is fine)."""
        self._worker_events.labels(self.model_name, worker_id, event).inc()

    def on_refused(self, error: APIError) -> None:
        """An HTTP request refused: counted if it is a 429 (the error code is the reason)."""
        if error.status != 429:
            return
        reason = error.code or "unknown"
        rejected = self._rejected_by_reason.get(reason)
        if rejected is None:
            rejected = self._rejected_by_reason[reason] = self._rejected.labels(
                self.model_name, reason)
        rejected.inc()


class NoRequestMetrics(RequestMetrics):
    """`--disable-metrics`: the request path's calls do nothing (used to measure their cost,
    and for operators who scrape nothing)."""

    def __init__(self) -> None:  # no registry, no families
        self.model_name = ""

    def on_admitted(self, num_prompt_tokens: int) -> None:
        pass

    def on_api_request(self, endpoint: str) -> None:
        pass

    def on_first_token(self, ttft_s: float, queue_s: float, prefill_s: float) -> None:
        pass

    def record_gap(self, since_last_s: float) -> None:
        pass

    def on_tokens(self, num_tokens: int) -> None:
        pass

    def on_finished(self, finish_reason: str, num_output_tokens: int, e2e_s: float,
                    prefill_s: float | None = None, decode_s: float | None = None) -> None:
        pass

    def on_worker_counters(self, worker_id: str, route: bytes, counters: dict[str, int]) -> None:
        pass

    def on_routed(self, model: str, version: str) -> None:
        pass

    def on_failover(self) -> None:
        pass

    def on_stale_output(self) -> None:
        pass

    def on_aborted(self, reason: str) -> None:
        pass

    def on_worker_event(self, worker_id: str, event: str) -> None:
        pass

    def on_refused(self, error: APIError) -> None:
        pass


class _LoopCollector(Collector):
    def __init__(self, requests: RequestMetrics):
        self.requests = requests

    def collect(self) -> Iterator[Metric]:
        return self.requests.collect_loop_owned()


class GatewayCollector(Collector):
    """Worker and gateway state, read at scrape time."""

    def __init__(self, gateway: GatewayState, model_name: str,
                 loop_monitor: Callable[[], LoopLagMonitor | None]):
        self.gateway = gateway
        self.model_name = model_name
        self.loop_monitor = loop_monitor

    def collect(self) -> Iterator[Metric]:
        m = self.model_name
        workers = list(self.gateway.registry.workers.values())
        per_worker = {
            "num_requests_running": ("Requests in the worker's running batch.",
                                     lambda w: w.num_running),
            "num_requests_waiting": ("Requests waiting in the worker's queue.",
                                     lambda w: w.num_waiting),
            "num_requests_paused": ("Streams paused in the worker for want of credit.",
                                    lambda w: w.num_paused),
            "kv_cache_usage_perc": ("KV cache use, 1 = full (1 - free/total blocks).",
                                    lambda w: 1 - w.num_free_blocks / w.num_total_blocks
                                    if w.num_total_blocks else 0.0),
        }
        for name, (doc, value) in per_worker.items():
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", "worker_id"])
            for w in workers:  # labelled with the worker's own model
                family.add_metric([w.model or m, w.worker_id], value(w))
            yield family
        by_status = GaugeMetricFamily(PREFIX + "workers", "Workers known, by status.",
                                      labels=["model_name", "status"])
        for status in WorkerStatus:
            by_status.add_metric([m, status.value],
                                 sum(1 for w in workers if w.status is status))
        yield by_status
        by_version = GaugeMetricFamily(PREFIX + "model_workers", "Workers known, by served "
                                       "model, version and status.",
                                       labels=["model_name", "version", "status"])
        counts: dict[tuple[str, str, str], int] = {}
        for w in workers:
            key = (w.model or m, w.version, w.status.value)
            counts[key] = counts.get(key, 0) + 1
        for labels, count in sorted(counts.items()):
            by_version.add_metric(list(labels), count)
        yield by_version
        queued = GaugeMetricFamily(PREFIX + "num_requests_queued_gateway",
                                   "Requests waiting in the gateway for a worker.",
                                   labels=["model_name"])
        queued.add_metric([m], self.gateway.admission.num_queued)
        yield queued
        dropped = CounterMetricFamily(PREFIX + "zmq_messages_dropped",
                                      "Malformed or refused messages from workers.",
                                      labels=["model_name"])
        dropped.add_metric([m], self.gateway.edge.num_dropped)
        yield dropped
        restarts = CounterMetricFamily(PREFIX + "zmq_receive_loop_restarts",
                                       "Times the ZeroMQ receive loop failed and was restarted.",
                                       labels=["model_name"])
        restarts.add_metric([m], self.gateway.edge.num_receive_restarts)
        yield restarts
        monitor = self.loop_monitor()
        if monitor is not None:
            yield from _loop_lag(monitor, m)


def _loop_lag(monitor: LoopLagMonitor, model_name: str) -> Iterator[Metric]:
    # A summary: quantiles over the last window of samples, count and sum since start.
    name = PREFIX + "event_loop_lag_seconds"
    lag = Metric(name, "Gateway event-loop lag (quantiles over the last window of samples).",
                 "summary")
    ordered = sorted(monitor.samples)
    for q in (0.5, 0.99, 1.0):
        value = ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0
        lag.add_sample(name, {"model_name": model_name, "quantile": str(q)}, value)
    lag.add_sample(name + "_count", {"model_name": model_name}, monitor.num_samples)
    lag.add_sample(name + "_sum", {"model_name": model_name}, monitor.lag_sum_s)
    yield lag
    stalls = CounterMetricFamily(PREFIX + "event_loop_stalls",
                                 "Event-loop lag samples at or above the warning threshold.",
                                 labels=["model_name"])
    stalls.add_metric([model_name], monitor.num_stalls)
    yield stalls


class Metrics:
    """One app's metrics: its registry, the request-path recorder, the scrape body."""

    def __init__(self, model_name: str, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                 tier: TierMetrics | None = None):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = RequestMetrics(self.registry, model_name, max_model_len)
        self._collector: GatewayCollector | None = None
        # One of N gateways sharing a port: a scrape answers for all (gateway/observability/tier_metrics.py).
        self.tier = tier

    def watch(self, gateway: GatewayState, loop_monitor: LoopLagMonitor | None = None) -> None:
        """Expose the gateway's worker and loop state (once)."""
        if self._collector is None:
            self._collector = GatewayCollector(gateway, self.model_name, lambda: loop_monitor)
            self.registry.register(self._collector)
            self.registry.register(FairnessCollector(gateway.admission, self.model_name))

    def exposition(self) -> tuple[bytes, str]:
        own = generate_latest(self.registry)
        if self.tier is not None:
            return self.tier.exposition(own), CONTENT_TYPE_LATEST
        return own, CONTENT_TYPE_LATEST

    async def write_tier_snapshots(self) -> None:
        """For a tier's other gateways: this one's figures, every WRITE_INTERVAL_S."""
        assert self.tier is not None
        while True:
            self.tier.write(generate_latest(self.registry))
            await asyncio.sleep(WRITE_INTERVAL_S)
