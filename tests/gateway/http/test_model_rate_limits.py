"""Rate limits per model: the limits file's `models` table limits each client's use of one
served model, and leaves the others alone."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.helpers import GatewayServer, byte_tokenizer
from zeroserve.gateway.key_limits import RateLimitConfigError, load_model_limits


def test_a_models_limit_applies_to_that_model_only(tmp_path):
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"models": {"tiny": {"requests_per_second": 0.01,
                                                      "burst": 2}}}))
    with GatewayServer(served_model_name="smollm", extra_models=("tiny=/none.gguf",),
                       model_aliases=("canary=tiny:1",), rate_limits_file=str(limits),
                       tokenizers={"tiny": byte_tokenizer()}) as gw:
        workers = [gw.worker(worker_id=f"w-{m}", served_model_name=m).start()
                   for m in ("smollm", "tiny")]
        assert all(w.ready.wait(5) for w in workers)

        def complete(model: str) -> httpx.Response:
            return httpx.post(f"{gw.url}/v1/completions", timeout=10,
                              json={"model": model, "prompt": "hi", "max_tokens": 2})

        assert [complete("tiny").status_code for _ in range(2)] == [200, 200]
        refused = complete("canary")  # an alias counts against the model it picks
        assert refused.status_code == 429 and "Retry-After" in refused.headers
        assert "model 'tiny'" in refused.json()["error"]["message"]
        assert [complete("smollm").status_code for _ in range(4)] == [200] * 4
        for w in workers:
            w.stop()


def test_bad_model_limits_fail_at_start(tmp_path):
    limits = tmp_path / "limits.toml"
    limits.write_text('[models.tiny]\nrequests_per_second = -1\n')
    with pytest.raises(RateLimitConfigError, match="models.tiny"):
        load_model_limits(str(limits))
