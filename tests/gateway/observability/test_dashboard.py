"""The Grafana dashboard and the monitoring compose profile: every metric a panel queries is
one the gateway really exposes, and the profile mounts files that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import yaml

from tests.gateway.helpers import GatewayServer, cyclic_reply, wait_until

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "docs" / "monitoring" / "grafana" / "zeroserve.json"
# Suffixes Prometheus adds to a family's samples (histograms and counters).
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def exposed_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_every_panel_queries_a_metric_the_gateway_exposes():
    with GatewayServer() as gw:
        counters = {"prefix_cache_queries": 4, "prefix_cache_hits": 2, "num_preemptions": 1}
        old = gw.worker(counters=counters).start()
        assert old.ready.wait(5)
        old.stop()  # and a restart, so the worker-event counter has a sample
        worker = gw.worker(reply=cyclic_reply("ab"), step_s=0.005, counters=counters).start()
        assert worker.ready.wait(5)
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=10, json={
                "prompt": "x", "max_tokens": 8, "stream": True}) as r:
            assert r.status_code == 200 and list(r.iter_lines())
        assert wait_until(lambda: all(name in httpx.get(gw.url + "/metrics").text for name in (
            "zeroserve:e2e_request_latency_seconds_count", "zeroserve:num_preemptions_total{",
            'event="restarted"')))
        exposed = exposed_names(httpx.get(gw.url + "/metrics").text)
        worker.stop()
    board = json.loads(DASHBOARD.read_text())
    queried = {name for panel in board["panels"] for target in panel["targets"]
               for name in re.findall(r"zeroserve:[a-z0-9_]+", target["expr"])}
    assert len(queried) >= 15
    missing = {name for name in queried if name not in exposed}
    assert not missing, f"panels query metrics that do not exist: {sorted(missing)}"
    # And each histogram quantile reads a real histogram.
    for name in queried:
        if name.endswith("_bucket"):
            assert name.removesuffix("_bucket") + "_count" in exposed


def test_the_monitoring_profile_mounts_what_exists_and_scrapes_the_gateway():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    monitoring = {n: s for n, s in services.items() if s.get("profiles") == ["monitoring"]}
    assert set(monitoring) == {"prometheus", "grafana"}
    for service in monitoring.values():
        for volume in service["volumes"]:
            assert (ROOT / volume.split(":")[0]).is_file(), volume
    prometheus = yaml.safe_load((ROOT / "docs/monitoring/prometheus.yml").read_text())
    [job] = prometheus["scrape_configs"]
    gateway_port = "8000"
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"gateway:{gateway_port}"]
    # Prometheus scrapes the gateway's container port on the compose network; the host sees
    # it on loopback only (the host port is ZEROSERVE_HTTP_PORT, 8000 by default).
    assert [p for p in services["gateway"]["ports"]
            if p.startswith("127.0.0.1:") and p.endswith(f":{gateway_port}")]
