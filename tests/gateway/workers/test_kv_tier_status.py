"""The box's KV tier in what the gateway says of a worker (`/admin/workers`, `workers list`)."""

from __future__ import annotations

from zeroserve.cli.admin import _kv_tier_text
from zeroserve.common.protocol import PROTOCOL_VERSION, Heartbeat, Hello
from zeroserve.gateway.workers.registry import WorkerRegistry


def registry_with(counters: dict[str, int]) -> WorkerRegistry:
    reg = WorkerRegistry()
    reg.register(Hello(PROTOCOL_VERSION, "w", "m", 2048, 100, 16, 4, "cpu", 1), b"w.1", 0.0)
    reg.on_heartbeat(Heartbeat("w", "ready", 0, 0, 0, 100, 100, 0.0, counters=counters), 0.1)
    return reg


def test_a_worker_with_the_tier_shows_its_figures():
    reg = registry_with({"prefix_cache_hits": 5, "kv_tier_hits": 42, "kv_tier_misses": 3,
                         "kv_tier_written_bytes": 7 << 20})
    described = reg.get("w").describe()
    assert described["kv_tier"] == {"hits": 42, "misses": 3, "written_bytes": 7 << 20}
    assert _kv_tier_text(described["kv_tier"]) == \
        " tier_hits=42 tier_misses=3 tier_written_mib=7"


def test_a_worker_without_the_tier_shows_nothing_of_it():
    described = registry_with({"prefix_cache_hits": 5}).get("w").describe()
    assert described["kv_tier"] is None
    assert _kv_tier_text(described["kv_tier"]) == ""
