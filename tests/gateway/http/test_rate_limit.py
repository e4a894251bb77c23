"""Per-key rate limits: the buckets on a fake clock, the per-key file, and 429s from the real
app on uvicorn with a fake worker."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.gateway.helpers import GatewayServer, byte_tokenizer, cyclic_reply
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


def test_a_generation_reserves_its_cost_and_gets_back_what_it_did_not_use():
    clock = Clock()
    limiter = RateLimiter(Limits(tokens_per_minute=600), clock=clock)  # 10 a second
    assert limiter.admit(0) is None and limiter.reserve(0, 500) is None
    assert limiter.admit(0) is None  # 100 left: admitted, but not for 200 more
    refused = limiter.reserve(0, 200)
    assert refused.status == 429 and refused.headers["Retry-After"] == "10"
    assert "may use 200" in refused.message and "100 are left" in refused.message
    limiter.finish(0, 50, 500)  # it used 50 of its 500: 450 come back
    assert limiter.reserve(0, 200) is None
    limiter.finish(0, 200, 200)
    assert limiter._keys[0].tokens.level == 350
    limiter.finish(0, 0, 10_000)  # never above a full bucket
    assert limiter._keys[0].tokens.level == 600


def test_a_generation_larger_than_the_bucket_needs_a_full_one_and_leaves_a_debt():
    clock = Clock()
    limiter = RateLimiter(Limits(tokens_per_minute=600), clock=clock)
    assert limiter.reserve(0, 1000) is None  # a full bucket: it may run
    assert limiter.admit(0).headers["Retry-After"] == "40"  # 400 in debt
    clock.now += 40
    assert limiter.admit(0) is None and limiter.reserve(0, 1000) is not None


def test_concurrent_requests_per_client():
    limiter = RateLimiter(Limits(max_concurrent_requests=2), {1: Limits()}, clock=Clock())
    assert limiter.admit(0) is None and limiter.admit(0) is None
    refused = limiter.admit(0)
    assert refused.status == 429 and refused.headers == {"Retry-After": "1"}
    assert "concurrent" in refused.message
    assert all(limiter.admit(1) is None for _ in range(10))  # unlimited key
    limiter.finish(0, 0)
    assert limiter.admit(0) is None
    limiter.finish(0, 0)
    limiter.finish(0, 0)
    assert limiter._in_flight == {}
    ip = ("ip", "10.0.0.1")
    assert limiter.admit(ip) is None and limiter.admit(ip) is None and limiter.admit(ip)
    limiter.finish(ip, 0)
    limiter.finish(ip, 0)
    assert limiter._in_flight == {}  # nothing kept per address once it is idle


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
    path.write_text(json.dumps({KEY: {"max_concurrent_requests": 4}}))
    assert load_key_limits(str(path), (KEY,), default) == {
        0: Limits(requests_per_second=5, tokens_per_minute=1000, max_concurrent_requests=4)}
    toml = tmp_path / "limits.toml"
    toml.write_text(f'["{KEY}"]\nrequests_per_second = 0.5\ntokens_per_minute = "unlimited"\n')
    assert load_key_limits(str(toml), (KEY,), default) == {
        0: Limits(requests_per_second=0.5)}


@pytest.mark.parametrize("content,fragment", [
    ({"sk-unknown": {}}, "not one of the API keys"),
    ({KEY: {"rps": 1}}, "only burst"),
    ({KEY: {"requests_per_second": 0}}, "requests_per_second must be"),
    ({KEY: {"burst": 1.5}}, "burst must be"),
    ({KEY: {"max_concurrent_requests": 0}}, "max_concurrent_requests must be"),
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


# 0.5 a second: a loaded machine's slow requests do not refill the bucket between the ones
# that must find it empty (at 2 a second, 0.5 s between the first and the third did).
@pytest.mark.parametrize("served", [dict(api_keys=(KEY, OTHER_KEY), rate_limit_rps=0.5,
                                         rate_limit_burst=2)], indirect=True)
def test_a_rate_limited_key_gets_429_and_recovers(served):
    def models(key: str) -> httpx.Response:
        return httpx.get(served.url + "/v1/models", headers=bearer(key))

    assert [models(KEY).status_code for _ in range(2)] == [200, 200]
    refused = models(KEY)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "2"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert models(OTHER_KEY).status_code == 200  # its own bucket
    assert httpx.get(served.url + "/health").status_code == 200  # health is never limited
    time.sleep(2.1)  # one request refilled (one in 2 s)
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
    # The next one may cost 6 + 20 = 26 as well, and only ~4 are left: refused up front.
    refused = httpx.post(served.url + "/v1/completions", json={**body, "stream": True},
                         headers=bearer(KEY))
    assert refused.status_code == 429, refused.text
    # 22 tokens short at half a token a second.
    assert 40 <= int(refused.headers["retry-after"]) <= 44
    assert "may use 26" in refused.json()["error"]["message"]
    # A smaller max_tokens fits what is left.
    small = httpx.post(served.url + "/v1/completions",
                       json={**body, "prompt": "hi", "max_tokens": 1}, headers=bearer(KEY))
    assert small.status_code == 200 and small.json()["usage"]["total_tokens"] == 3


@pytest.mark.parametrize("served", [dict(rate_limit_rps=0.1)], indirect=True)  # burst 1
def test_without_keys_limits_apply_per_client_ip(served):
    assert httpx.get(served.url + "/v1/models").status_code == 200
    assert httpx.get(served.url + "/v1/models").status_code == 429


def test_one_key_at_its_concurrency_limit_leaves_the_others_served(tmp_path):
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({KEY: {"max_concurrent_requests": 1}}))
    body = {"model": MODEL, "prompt": "Say hi", "max_tokens": 30, "stream": True}
    with GatewayServer(api_keys=(KEY, OTHER_KEY), rate_limits_file=str(limits)) as gw:
        worker = gw.worker(reply=cyclic_reply("ab"), step_s=0.05).start()
        try:
            assert worker.ready.wait(5)
            with httpx.stream("POST", gw.url + "/v1/completions", json=body,
                              headers=bearer(KEY), timeout=10) as first:
                assert first.status_code == 200
                refused = httpx.post(gw.url + "/v1/completions", json=body,
                                     headers=bearer(KEY))
                assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
                assert "concurrent" in refused.json()["error"]["message"]
                other = httpx.post(gw.url + "/v1/completions",
                                   json={**body, "stream": False}, headers=bearer(OTHER_KEY))
                assert other.status_code == 200
                assert first.read().endswith(b"data: [DONE]\n\n")
            again = httpx.post(gw.url + "/v1/completions", json={**body, "stream": False},
                               headers=bearer(KEY))
            assert again.status_code == 200
        finally:
            worker.stop()


def test_tokens_are_reserved_while_a_stream_runs_and_given_back_after():
    body = {"model": MODEL, "prompt": "Say hi", "max_tokens": 80, "stream": True}
    with GatewayServer(api_keys=(KEY,), rate_limit_tpm=100) as gw:
        worker = gw.worker(reply=cyclic_reply("ab"), step_s=0.05).start()
        try:
            assert worker.ready.wait(5)
            with httpx.stream("POST", gw.url + "/v1/completions",
                              json={**body, "max_tokens": 20}, headers=bearer(KEY),
                              timeout=10) as first:
                assert first.status_code == 200
                # 26 reserved of 100: another 86 do not fit while it runs (before, both
                # were admitted and charged only when they ended).
                refused = httpx.post(gw.url + "/v1/completions", json=body,
                                     headers=bearer(KEY))
                assert refused.status_code == 429, refused.text
                first.read()
            r = httpx.post(gw.url + "/v1/completions", json={**body, "max_tokens": 60},
                           headers=bearer(KEY))
            assert r.status_code == 200  # 26 used, nothing withheld: 66 fit
        finally:
            worker.stop()


# --- requests that never ran are not billed (issue 35, item 13) -------------------------------

@pytest.mark.parametrize("overrides", [dict(max_queued_requests=0),  # 429: the queue is full
                                       dict(queue_timeout_s=0.2)])  # 503: no worker in time
def test_requests_that_never_ran_cost_no_tokens(overrides):
    body = {"model": MODEL, "prompt": "x" * 40, "max_tokens": 10}
    with GatewayServer(api_keys=(KEY,), rate_limit_tpm=100, **overrides) as gw:
        for _ in range(3):  # 3 x 40 prompt tokens: more than a minute's budget if billed
            r = httpx.post(gw.url + "/v1/completions", json=body, headers=bearer(KEY),
                           timeout=10)
            assert r.status_code in (429, 503), r.text
            assert "Rate limit" not in r.json()["error"]["message"]
        worker = gw.worker().start()
        try:
            assert worker.ready.wait(5)
            # 40 + 50 = 90 of the 100: it fits only if the refused ones cost nothing.
            r = httpx.post(gw.url + "/v1/completions", json={**body, "max_tokens": 50},
                           headers=bearer(KEY), timeout=10)
            assert r.status_code == 200, r.text
        finally:
            worker.stop()


def test_a_group_whose_choices_never_reached_a_worker_bills_nothing():
    """The client gone while queued: its choices end unsubmitted, and cost nothing; one that
    ran costs its prompt and output."""
    from zeroserve.gateway.generation import RequestGroup

    with GatewayServer() as gw:
        gateway = gw.app.state.gateway
        queued = RequestGroup(gateway)
        for prompt in ([1, 2, 3], [4, 5]):
            queued.add(prompt, {}, byte_tokenizer(), (), True)
            queued.prompt_lengths.append(len(prompt))
        queued.close()
        assert queued.num_billed_tokens == 0 and queued.usage()["prompt_tokens"] == 5
        queued.choices[1].state.num_submits = 1  # the second prompt reached a worker
        assert queued.num_billed_tokens == 2
