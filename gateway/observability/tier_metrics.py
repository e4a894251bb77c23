"""`/metrics` for a tier of gateway processes sharing one port (`serve --gateways N`).

A scrape of the shared port reaches whichever gateway the kernel picks, and each process
counts only its own clients' requests: scraped as they are, counters would jump between
processes' values and dashboards would show nonsense. So the gateways of a tier share a
folder (`--metrics-dir`), each writes its exposition there every `WRITE_INTERVAL_S`, and
`/metrics` on any of them answers for the whole tier (its own figures fresh):

- the gateways' own figures (requests, tokens, latencies, queue, event loop) once per
  gateway, each series labelled `gateway="<index>"`: `sum without (gateway)` (or the
  dashboard's `sum(rate(...))`) adds them up, and a gateway that restarts resets only its
  own series, which `rate()` takes in its stride;
- what describes the workers (their gauges, counters from heartbeats, restarts seen) once,
  as every gateway sees the same workers: from the live gateway with the lowest index,
  without a `gateway` label, so the queries of a one-gateway deployment work unchanged.

A snapshot older than `STALE_S` is a gateway that is gone (or stalled): it is left out.
The others' figures are at most `WRITE_INTERVAL_S` old.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from zeroserve.gateway.config import make_private_dirs
from zeroserve.gateway.logging import get_logger

log = get_logger("metrics")

WRITE_INTERVAL_S = 1.0
STALE_S = 10.0
PREFIX = "zeroserve:"
# Families that describe the workers: the same in every gateway of the tier. (The parser
# names a counter's family without its "_total".)
WORKER_FAMILIES = frozenset(PREFIX + name for name in (
    "num_requests_running", "num_requests_waiting", "num_requests_paused",
    "kv_cache_usage_perc", "workers", "prefix_cache_queries", "prefix_cache_hits",
    "num_preemptions", "worker_events", "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos", "kv_tier_hits", "kv_tier_misses",
    "kv_tier_read_bytes", "kv_tier_written_bytes", "kv_tier_evictions",
    "kv_tier_load_microseconds"))


class TierMetrics:
    def __init__(self, folder: str, index: int):
        self.folder = Path(folder)
        self.index = index
        make_private_dirs(self.folder)  # it may be the first to make the ipc:// folder
        self._path = self.folder / f"gateway-{index}.prom"

    def write(self, own: bytes) -> None:
        """This gateway's exposition, for the others' scrapes (replaced atomically)."""
        tmp = self._path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_bytes(own)
            os.replace(tmp, self._path)
        except OSError as e:
            log.warning("cannot write the tier's metrics snapshot", extra={
                "path": str(self._path), "error": str(e)})

    def exposition(self, own: bytes) -> bytes:
        """The whole tier's figures, answering a scrape of this gateway."""
        snapshots = {self.index: own}
        now = time.time()
        for path in self.folder.glob("gateway-*.prom"):
            try:
                index = int(path.stem.split("-", 1)[1])
                if index == self.index or now - path.stat().st_mtime > STALE_S:
                    continue
                snapshots[index] = path.read_bytes()
            except (OSError, ValueError):
                continue  # a file being replaced, or not one of ours
        return merge(snapshots)


def merge(snapshots: dict[int, bytes]) -> bytes:
    """Gateway index -> its exposition text => one exposition for the tier (see above)."""
    families: dict[str, Metric] = {}
    first = min(snapshots)
    for index in sorted(snapshots):
        for family in text_string_to_metric_families(snapshots[index].decode()):
            is_worker = family.name in WORKER_FAMILIES
            if is_worker and index != first:
                continue
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
            for sample in family.samples:
                labels = sample.labels if is_worker else {**sample.labels,
                                                          "gateway": str(index)}
                merged.add_sample(sample.name, labels, sample.value, sample.timestamp)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families(Collector):
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return iter(self.families)
