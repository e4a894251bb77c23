"""/metrics of a tier of gateways (`serve --gateways N`): any gateway answers for all."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.workers.test_registry import hello
from zeroserve.gateway.observability.metrics import Metrics
from zeroserve.gateway.observability.tier_metrics import STALE_S, TierMetrics


def samples(text: bytes, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text.decode())
            for s in f.samples if s.name == name}


class _Gateway:
    """What GatewayCollector reads of a gateway: one ready worker."""

    def __init__(self):
        from zeroserve.gateway.admission import Admission
        from zeroserve.gateway.workers.registry import WorkerRegistry

        self.registry = WorkerRegistry()
        self.registry.register(hello("w"), b"w.1", 0.0)
        self.admission = Admission(self.registry, max_queued=1, timeout_s=1)
        self.edge = type("E", (), {"num_dropped": 0, "num_receive_restarts": 0})()


def test_each_gateways_own_figures_are_labelled_and_worker_figures_come_once(tmp_path):
    tiers = [Metrics("m", tier=TierMetrics(str(tmp_path), i)) for i in range(2)]
    for i, metrics in enumerate(tiers):
        metrics.watch(_Gateway())
        metrics.requests.on_tokens(10 * (i + 1))
        metrics.tier.write(metrics.exposition()[0])
    for metrics in tiers:  # whichever gateway the scrape reaches
        text, _ = metrics.exposition()
        tokens = samples(text, "zeroserve:generation_tokens_total")
        assert tokens == {(("gateway", "0"), ("model_name", "m")): 10.0,
                          (("gateway", "1"), ("model_name", "m")): 20.0}
        ready = samples(text, "zeroserve:workers")
        assert ready[(("model_name", "m"), ("status", "ready"))] == 1.0  # not 2
        assert all("gateway" not in dict(k) for k in ready)


def test_a_gateway_gone_silent_is_left_out(tmp_path):
    a, b = (Metrics("m", tier=TierMetrics(str(tmp_path), i)) for i in range(2))
    b.requests.on_tokens(5)
    b.tier.write(b.exposition()[0])
    old = time.time() - STALE_S - 1
    os.utime(tmp_path / "gateway-1.prom", (old, old))
    tokens = samples(a.exposition()[0], "zeroserve:generation_tokens_total")
    assert list(tokens) == [(("gateway", "0"), ("model_name", "m"))]


def test_a_tier_starts_on_a_fresh_machine_under_the_usual_umask(tmp_path):
    """`serve --gateways 2` on a fresh machine: its ipc:// folder does not exist yet, and the
    first gateway's metrics folder (inside it) was made first, with the umask's mode; the
    private-folder check of the ipc:// sockets then refused it and no gateway started."""
    import httpx

    from tests.gateway.helpers import GatewayServer

    # As the temp dir's zeroserve-UID, not made yet; under a short folder of its own, since an
    # ipc:// path may not pass 107 characters (pytest's numbered tmp_path can).
    short = Path(tempfile.mkdtemp(prefix="zs-"))
    ipc_dir = short / "zeroserve-uid"
    router, tokens = (f"ipc://{ipc_dir}/gw-8000-1-{kind}.sock" for kind in ("router", "tokens"))
    previous = os.umask(0o022)
    try:
        with GatewayServer(metrics_dir=str(ipc_dir / "gw-8000-metrics"), gateway_index=1,
                           router_address=router, tokens_address=tokens) as gw:
            assert httpx.get(gw.url + "/metrics").status_code == 200
    finally:
        os.umask(previous)
    try:
        for folder in (ipc_dir, ipc_dir / "gw-8000-metrics"):
            assert folder.stat().st_mode & 0o777 == 0o700, folder
    finally:
        shutil.rmtree(short, ignore_errors=True)
