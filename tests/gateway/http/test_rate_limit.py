"""Per-key rate limits: the buckets on a fake clock, the per-key file, and 429s from the real
app on uvicorn with a fake worker."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.gateway.helpers import GatewayServer
from zeroserve.gateway.http.rate_limit import RateLimiter
from zeroserve.gateway.key_limits import Limits, RateLimitConfigError, load_key_limits

MODEL = "SmolLM2-135M-Instruct"
KEY, OTHER_KEY = "sk-rate-one", "sk-rate-two"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --- the buckets ------------------------------------------------------------------------------

def test_requests_per_second_with_a_burst():
    clock = Clock()
    limiter = RateLimiter(Limits(requests_per_second=2, burst=3), clock=clock)
    assert [limiter.admit(0) for _ in range(3)] == [None, None, None]
    refused = limiter.admit(0)
    assert refused.status == 429 and refused.headers == {"Retry-After": "1"}
    assert refused.body()["error"]["type"] == "rate_limit_error"
    assert refused.body()["error"]["code"] == "rate_limit_exceeded"
    assert limiter.admit(1) is None  # another key has its own bucket
    clock.now += 0.5  # one request refilled
    assert limiter.admit(0) is None and limiter.admit(0) is not None


def test_tokens_are_charged_after_the_fact_and_the_debt_refills():
    clock = Clock()
    limiter = RateLimiter(Limits(tokens_per_minute=600), clock=clock)  # 10 a second
    assert limiter.admit(0) is None
    limiter.charge(0, 900)  # one long reply: 300 tokens in debt
    refused = limiter.admit(0)
    assert refused is not None and refused.headers["Retry-After"] == "30"
    assert "tokens" in refused.message
    clock.now += 29
    assert limiter.admit(0) is not None
    clock.now += 1
    assert limiter.admit(0) is None  # back to zero: admitted, whatever it will cost


def test_per_key_limits_override_the_default():
    clock = Clock()
    limiter = RateLimiter(Limits(requests_per_second=1),
                          {1: Limits(requests_per_second=None)}, clock=clock)
    assert limiter.admit(0) is None and limiter.admit(0) is not None
    assert all(limiter.admit(1) is None for _ in range(100))


def test_ip_buckets_are_bounded():
    limiter = RateLimiter(Limits(requests_per_second=1), max_ip_buckets=3, clock=Clock())
    for i in range(10):
        assert limiter.admit(("ip", f"10.0.0.{i}")) is None
    assert len(limiter._ips) == 3 and len(limiter._keys) == 0


def test_unlimited_keeps_no_buckets():
    limiter = RateLimiter(Limits())
    assert not limiter.is_enabled
    assert limiter.admit(0) is None and limiter.admit(("ip", "1.2.3.4")) is None
    assert not limiter._keys and not limiter._ips


# --- the per-key file -------------------------------------------------------------------------

def test_key_limits_file_json_and_toml(tmp_path):
    default = Limits(requests_per_second=5, tokens_per_minute=1000)
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({OTHER_KEY: {"requests_per_second": 1, "burst": 2},
                                KEY: {"tokens_per_minute": None}}))
    assert load_key_limits(str(path), (KEY, OTHER_KEY), default) == {
        1: Limits(requests_per_second=1, burst=2, tokens_per_minute=1000),
        0: Limits(requests_per_second=5, tokens_per_minute=None)}
    toml = tmp_path / "limits.toml"
    toml.write_text(f'["{KEY}"]\nrequests_per_second = 0.5\ntokens_per_minute = "unlimited"\n')
    assert load_key_limits(str(toml), (KEY,), default) == {
        0: Limits(requests_per_second=0.5)}


@pytest.mark.parametrize("content,fragment", [
    ({"sk-unknown": {}}, "not one of the API keys"),
    ({KEY: {"rps": 1}}, "only burst"),
    ({KEY: {"requests_per_second": 0}}, "requests_per_second must be"),
    ({KEY: {"burst": 1.5}}, "burst must be"),
    ([KEY], "must map"),
])
def test_bad_key_limits_files_are_refused_without_naming_keys(tmp_path, content, fragment):
    path = tmp_path / "limits.json"
    path.write_text(json.dumps(content))
    with pytest.raises(RateLimitConfigError) as caught:
        load_key_limits(str(path), (KEY,), Limits())
    assert fragment in str(caught.value)
    assert KEY not in str(caught.value) and "sk-unknown" not in str(caught.value)


# --- against the app --------------------------------------------------------------------------

@pytest.fixture
def served(request):
    """A gateway with the given config overrides and one ready fake worker."""
    with GatewayServer(**request.param) as gw:
        worker = gw.worker().start()
        assert worker.ready.wait(5)
        yield gw
        worker.stop()


@pytest.mark.parametrize("served", [dict(api_keys=(KEY, OTHER_KEY), rate_limit_rps=2,
                                         rate_limit_burst=2)], indirect=True)
def test_a_rate_limited_key_gets_429_and_recovers(served):
    def models(key: str) -> httpx.Response:
        return httpx.get(served.url + "/v1/models", headers=bearer(key))

    assert [models(KEY).status_code for _ in range(2)] == [200, 200]
    refused = models(KEY)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert models(OTHER_KEY).status_code == 200  # its own bucket
    assert httpx.get(served.url + "/health").status_code == 200  # health is never limited
    time.sleep(0.6)  # one request refilled (2 a second)
    assert models(KEY).status_code == 200

    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        for _ in range(3):
            client.models.list()


@pytest.mark.parametrize("served", [dict(api_keys=(KEY,), rate_limit_tpm=30)], indirect=True)
def test_tokens_per_minute(served):
    body = {"model": MODEL, "prompt": "Say hi", "max_tokens": 20}
    r = httpx.post(served.url + "/v1/completions", json=body, headers=bearer(KEY))
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 26
    # A stream's tokens count when it ends: 26 + 26 > 30, so the key is now in debt.
    with httpx.stream("POST", served.url + "/v1/completions", json={**body, "stream": True},
                      headers=bearer(KEY)) as stream:
        assert stream.status_code == 200
        assert stream.read().endswith(b"data: [DONE]\n\n")
    refused = httpx.post(served.url + "/v1/completions", json=body, headers=bearer(KEY))
    assert refused.status_code == 429, refused.text
    # 22 tokens in debt at half a token a second.
    assert 40 <= int(refused.headers["retry-after"]) <= 44
    assert "tokens" in refused.json()["error"]["message"]


@pytest.mark.parametrize("served", [dict(rate_limit_rps=1)], indirect=True)
def test_without_keys_limits_apply_per_client_ip(served):
    assert httpx.get(served.url + "/v1/models").status_code == 200
    assert httpx.get(served.url + "/v1/models").status_code == 429
