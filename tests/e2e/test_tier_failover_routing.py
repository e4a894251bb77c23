"""Real workers and the box's KV tier, as the gateway routes (issue 37): `serve --workers 2`
on a tiny real model with the tier on. Both workers' HELLOs name one tier."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import MODEL
from tests.worker.conftest import write_tiny_chat_model

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def server(module_servers, tmp_path_factory):
    model = write_tiny_chat_model(tmp_path_factory.mktemp("model"), seed=5)
    tier = tmp_path_factory.mktemp("tier") / "kv"
    return module_servers(args=(
        "--model", str(model), "--served-model-name", MODEL, "--device", "cpu",
        "--dtype", "float32", "--workers", "2", "--max-model-len", "512",
        "--num-kv-blocks", "256", "--kv-offloading-size", "0.05",
        "--kv-offloading-dir", str(tier)), num_workers=2, timeout_s=180,
        env={"ZEROSERVE_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))})


def test_both_workers_name_one_tier(server):
    workers = server.workers()
    assert len(workers) == 2
    ids = {w["kv_tier_id"] for w in workers}
    assert len(ids) == 1 and None not in ids, workers
