"""API keys, health redaction, CORS and allowed hosts, against the real app on uvicorn with a
fake worker."""

from __future__ import annotations

import logging
import os

import httpx
import openai
import pytest

from tests.gateway.helpers import GatewayServer
from zeroserve.gateway.config import GatewayConfig
from zeroserve.gateway.http.auth import ApiKeys, warn_if_exposed

MODEL = "SmolLM2-135M-Instruct"
KEY, OTHER_KEY = "sk-test-one", "sk-test-two"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed():
    """A gateway with two API keys and one ready fake worker."""
    with GatewayServer(api_keys=(KEY, OTHER_KEY)) as gw:
        worker = gw.worker().start()
        assert worker.ready.wait(5)
        yield gw
        worker.stop()


def assert_invalid_key(r: httpx.Response) -> None:
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json() == {"error": {
        "message": "Invalid or missing API key: send 'Authorization: Bearer KEY' with one of "
                   "the server's API keys.",
        "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


@pytest.mark.parametrize("headers", [
    {}, bearer("sk-wrong"), bearer(KEY[:-1]), bearer(KEY + "x"), {"Authorization": KEY},
    {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer"},
], ids=["none", "wrong", "prefix", "longer", "no-scheme", "basic", "empty"])
def test_missing_or_wrong_key_is_401(keyed, headers):
    for method, path in [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                         ("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("GET", "/v1/no-such-endpoint")]:
        r = httpx.request(method, keyed.url + path, headers=headers, json={})
        assert_invalid_key(r)


def test_every_configured_key_works(keyed):
    for key in (KEY, OTHER_KEY):
        r = httpx.post(keyed.url + "/v1/chat/completions", json=CHAT, headers=bearer(key))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        assert httpx.get(keyed.url + "/v1/models", headers=bearer(key)).status_code == 200
        r = httpx.post(keyed.url + "/tokenize", json={"prompt": "ab"}, headers=bearer(key))
        assert r.json()["tokens"] == [97, 98]
    # The scheme is case-insensitive, as in RFC 7235.
    r = httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"bearer {KEY}"})
    assert r.status_code == 200


def test_health_says_only_the_status_without_a_key(keyed):
    live = httpx.get(keyed.url + "/health/live")
    assert live.status_code == 200 and live.json() == {"status": "ok"}
    health = httpx.get(keyed.url + "/health", headers=bearer("sk-wrong"))
    assert health.status_code == 200
    assert health.json() == {"status": "ready", "num_ready_workers": 1}
    assert httpx.get(keyed.url + "/health/ready").json() == {"status": "ready",
                                                             "num_ready_workers": 1}
    # With a key: the full view that serve's supervisor and `zeroserve check` read.
    live = httpx.get(keyed.url + "/health/live", headers=bearer(OTHER_KEY)).json()
    assert live == {"status": "ok", "pid": os.getpid()}
    full = httpx.get(keyed.url + "/health", headers=bearer(KEY)).json()
    assert [w["worker_id"] for w in full["workers"]] == ["fake-0"]
    assert full["workers"][0]["status"] == "ready" and "pid" in full["workers"][0]


def test_supervisor_probe_and_check_send_the_key(keyed):
    from click.testing import CliRunner

    from zeroserve.cli import main as cli
    from zeroserve.cli.children import GatewayReadiness

    worker = keyed.gateway.registry.workers["fake-0"]
    pids = {"gateway": os.getpid(), "fake-0": worker.hello.pid}
    assert GatewayReadiness(keyed.url)(pids) == set()
    assert GatewayReadiness(keyed.url, KEY)(pids) == {"gateway", "fake-0"}

    def check(env: dict[str, str]):
        return CliRunner().invoke(cli.main, ["check", "--url", keyed.url, "--worker-id",
                                             "fake-0"], env=env)
    refused = check({})
    assert refused.exit_code == 1 and "ZEROSERVE_API_KEY" in refused.output
    assert check({"ZEROSERVE_API_KEY": f"{OTHER_KEY},{KEY}"}).exit_code == 0


def test_openai_client_with_and_without_the_key(keyed):
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(model=MODEL, max_tokens=5,
                                           messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content
    chunks = list(client.completions.create(model=MODEL, prompt="x", max_tokens=3,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert [m.id for m in client.models.list()] == [MODEL]

    anonymous = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        anonymous.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": "hi"}])
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


def test_without_keys_everything_is_open():
    with GatewayServer() as gw:
        assert httpx.get(gw.url + "/v1/models").status_code == 200
        assert "pid" in httpx.get(gw.url + "/health/live").json()
        assert "workers" in httpx.get(gw.url + "/health").json()


# --- CORS and hosts -----------------------------------------------------------------------

def preflight(gw, origin: str) -> httpx.Response:
    return httpx.options(gw.url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_preflight_allowed_and_denied():
    with GatewayServer(api_keys=(KEY,), allowed_origins=("https://app.example",)) as gw:
        ok = preflight(gw, "https://app.example")
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in ok.headers["access-control-allow-methods"]
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()

        denied = preflight(gw, "https://evil.example")
        assert denied.status_code == 400
        assert "access-control-allow-origin" not in denied.headers
        # A page of the allowed origin can read replies, a 401 included; another cannot.
        r = httpx.get(gw.url + "/v1/models", headers={"Origin": "https://app.example"})
        assert r.status_code == 401
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.get(gw.url + "/v1/models", headers={"Origin": "https://evil.example",
                                                      **bearer(KEY)})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_no_cors_policy_by_default(keyed):
    r = preflight(keyed, "https://app.example")
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(keyed.url + "/v1/models", headers={"Origin": "https://app.example",
                                                     **bearer(KEY)})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_allowed_hosts():
    with GatewayServer(allowed_hosts=("api.example",)) as gw:
        assert httpx.get(gw.url + "/v1/models", headers={"Host": "api.example"}).status_code \
            == 200
        refused = httpx.get(gw.url + "/v1/models", headers={"Host": "rebound.attacker.example"})
        assert refused.status_code == 421
        assert refused.json()["error"]["code"] == "host_not_allowed"
        assert httpx.get(gw.url + "/health/live").status_code == 200  # 127.0.0.1: loopback


# --- configuration and the exposure warning --------------------------------------------------

def test_keys_never_appear_in_repr_or_errors():
    config = GatewayConfig(api_keys=(KEY, OTHER_KEY))
    assert KEY not in repr(config) and OTHER_KEY not in repr(config)
    for bad in [("sk-ok", "with space"), ("sk-ok", "a,b"), ("",), (KEY, KEY)]:
        with pytest.raises(ValueError) as caught:
            GatewayConfig(api_keys=bad)
        assert all(k not in str(caught.value) for k in bad if k)


@pytest.mark.parametrize("host,keys,warns", [
    ("0.0.0.0", (), True), ("192.168.1.5", (), True), ("api.example", (), True),
    ("0.0.0.0", (KEY,), False), ("127.0.0.1", (), False), ("::1", (), False),
    ("localhost", (), False),
])
def test_non_loopback_without_a_key_warns(caplog, host, keys, warns):
    with caplog.at_level(logging.WARNING, logger="zeroserve.gateway.http.auth"):
        warn_if_exposed(host, ApiKeys(keys))
    assert ("SECURITY WARNING" in caplog.text) == warns
