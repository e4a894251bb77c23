"""The gateway queue's figures per priority class and per key, read at scrape time from the
admission's statistics (gateway/queue_stats.py), with bounded labels (classes as configured;
keys as `key-N` for the first 64 API keys, `other` beyond, `anonymous` without keys):

- `zeroserve:gateway_queue_requests{priority_class}` / `..._by_key{key}`: waiting now;
- `zeroserve:gateway_queue_wait_seconds{priority_class}`: a histogram of the wait of the
  requests that left the queue for a worker (`..._by_key`: sum and count);
- `zeroserve:gateway_shed_requests_total{priority_class}` / `..._by_key{key}`: refused
  (429) for want of room in the queue, or displaced from it by a higher class;
- `zeroserve:priority_class_share{priority_class}`: each class's share now.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

PREFIX = "zeroserve:"
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                120.0)  # the same bounds as gateway/queue_stats.py's


class _Admission(Protocol):
    stats: Any  # gateway/queue_stats.py's QueueStats

    def shares(self) -> dict[str, float]: ...


class FairnessCollector(Collector):
    def __init__(self, admission: _Admission, model_name: str):
        self.admission = admission
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        m = self.model_name
        stats = self.admission.stats
        labels = ["model_name", "priority_class"]
        queued = GaugeMetricFamily(PREFIX + "gateway_queue_requests",
                                   "Requests waiting in the gateway's queue, by priority class.",
                                   labels=labels)
        shed = CounterMetricFamily(PREFIX + "gateway_shed_requests",
                                   "Requests refused for want of room in the gateway's queue "
                                   "or displaced from it by a higher class, by class.",
                                   labels=labels)
        wait = HistogramMetricFamily(PREFIX + "gateway_queue_wait_seconds",
                                     "Time requests waited in the gateway's queue before a "
                                     "worker took them, by priority class.", labels=labels)
        for name, figures in zip(stats.class_names, stats.by_class, strict=True):
            queued.add_metric([m, name], figures.num_queued)
            shed.add_metric([m, name], figures.num_shed)
            cumulative, buckets = 0, []
            for bound, count in zip((*WAIT_BUCKETS, float("inf")), figures.buckets,
                                    strict=True):
                cumulative += count
                buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
            wait.add_metric([m, name], buckets, figures.wait_sum_s)
        share = GaugeMetricFamily(PREFIX + "priority_class_share",
                                  "Each priority class's share of the queue's service now.",
                                  labels=labels)
        for name, value in self.admission.shares().items():
            share.add_metric([m, name], value)
        yield from (queued, shed, wait, share)
        key_labels = ["model_name", "key"]
        by_key = sorted(stats.by_key.items())
        queued_k = GaugeMetricFamily(PREFIX + "gateway_queue_requests_by_key",
                                     "Requests waiting in the gateway's queue, by API key "
                                     "(key-N: its index among the keys).", labels=key_labels)
        shed_k = CounterMetricFamily(PREFIX + "gateway_shed_requests_by_key",
                                     "Requests shed from the gateway's queue, by API key.",
                                     labels=key_labels)
        wait_sum = CounterMetricFamily(PREFIX + "gateway_queue_wait_seconds_by_key_sum",
                                       "Seconds waited in the gateway's queue, by API key "
                                       "(with _count: the mean wait).", labels=key_labels)
        wait_count = CounterMetricFamily(PREFIX + "gateway_queue_wait_seconds_by_key_count",
                                         "Requests that left the gateway's queue for a "
                                         "worker, by API key.", labels=key_labels)
        for label, figures in by_key:
            queued_k.add_metric([m, label], figures.num_queued)
            shed_k.add_metric([m, label], figures.num_shed)
            wait_sum.add_metric([m, label], figures.wait_sum_s)
            wait_count.add_metric([m, label], figures.wait_count)
        yield from (queued_k, shed_k, wait_sum, wait_count)
