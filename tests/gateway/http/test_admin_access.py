"""Who may operate workers through the admin API, against the real app on uvicorn with a fake
worker: admin keys only (an API key never), loopback clients when no admin key is set, and
never a web page (cross-site requests, DNS rebinding)."""

from __future__ import annotations

import socket

import httpx
import pytest
from click.testing import CliRunner

from tests.gateway.helpers import GatewayServer, wait_until
from zeroserve.cli import main as cli
from zeroserve.cli.admin_client import AdminClient

API_KEY, ADMIN_KEY = "sk-customer", "sk-operator"
DRAIN = "/admin/workers/fake-0/drain"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def this_hosts_address() -> str | None:
    """A non-loopback IPv4 address of this machine (a client from it is not on loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET: only picks a route, sends nothing
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


class Server:
    """A gateway reachable on all interfaces, with one ready fake worker."""

    def __init__(self, **config):
        self.gw = GatewayServer(uvicorn_overrides={"host": "0.0.0.0"}, **config)

    def __enter__(self) -> Server:
        self.gw.__enter__()
        self.worker = self.gw.worker().start()
        assert self.worker.ready.wait(5)
        return self

    def __exit__(self, *exc) -> None:
        self.worker.stop()
        self.gw.__exit__(*exc)

    @property
    def local_url(self) -> str:
        return self.gw.url

    @property
    def remote_url(self) -> str:
        address = this_hosts_address()
        if address is None:
            pytest.skip("this machine has no non-loopback address to connect from")
        return f"http://{address}:{self.gw.port}"

    def status(self) -> str:
        return self.gw.gateway.registry.workers["fake-0"].describe()["status"]


def assert_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_an_api_key_never_grants_admin():
    with Server(host="0.0.0.0", api_keys=(API_KEY,)) as server:
        remote = server.remote_url
        assert httpx.get(remote + "/v1/models", headers=bearer(API_KEY)).status_code == 200
        assert_error(httpx.get(remote + "/admin/workers", headers=bearer(API_KEY)), 403,
                     "admin_forbidden")
        assert_error(httpx.post(remote + DRAIN, headers=bearer(API_KEY), json={}), 403,
                     "admin_forbidden")
        assert server.status() == "ready"  # the customer drained nothing
        # The operator on the gateway's machine needs no key: `zeroserve workers ...` works.
        listed = CliRunner().invoke(cli.main, ["workers", "list", "--url", server.local_url],
                                    env={"ZEROSERVE_ADMIN_KEY": None})
        assert listed.exit_code == 0 and "fake-0" in listed.output, listed.output
        drained = CliRunner().invoke(cli.main, ["workers", "drain", "fake-0", "--url",
                                                server.local_url])
        assert drained.exit_code == 0, drained.output
        assert server.status() == "draining"
        undrained = CliRunner().invoke(cli.main, ["workers", "undrain", "fake-0", "--url",
                                                  server.local_url])
        assert undrained.exit_code == 0, undrained.output
        assert wait_until(lambda: server.status() == "ready")  # as its next heartbeat says


def test_a_proxied_request_is_not_a_loopback_client():
    """A reverse proxy on the gateway's machine connects from loopback for remote clients."""
    with Server(api_keys=(API_KEY,)) as server:
        for header in ({"X-Forwarded-For": "203.0.113.7"}, {"Forwarded": "for=203.0.113.7"},
                       {"X-Real-IP": "203.0.113.7"}):
            r = httpx.post(server.local_url + DRAIN, json={}, headers={**bearer(API_KEY),
                                                                       **header})
            assert_error(r, 403, "admin_forbidden")
        assert server.status() == "ready"


def test_with_an_admin_key_only_that_key_operates_workers():
    with Server(host="0.0.0.0", api_keys=(API_KEY,), admin_keys=(ADMIN_KEY,)) as server:
        for url in (server.local_url, server.remote_url):
            for headers in ({}, bearer(API_KEY), bearer("sk-wrong")):
                assert_error(httpx.get(url + "/admin/workers", headers=headers), 401,
                             "invalid_admin_key")
            assert AdminClient(url, ADMIN_KEY).workers()[0]["worker_id"] == "fake-0"
        # An admin key is not an API key either.
        r = httpx.get(server.remote_url + "/v1/models", headers=bearer(ADMIN_KEY))
        assert r.status_code == 401


# --- a web page on the operator's machine -----------------------------------------------------

@pytest.mark.parametrize("headers,content", [
    # What an HTML form or a "simple" fetch() may send cross-site without a preflight.
    ({"Content-Type": "text/plain"}, b'{"deadline_s": 0}'),
    ({"Content-Type": "application/x-www-form-urlencoded"}, b"deadline_s=0"),
    ({"Content-Type": "multipart/form-data; boundary=x"}, b"--x--"),
    ({}, b""),
], ids=["text-plain", "form", "multipart", "no-type"])
def test_a_simple_cross_site_post_cannot_drain(headers, content):
    with Server() as server:
        page = {"Origin": "http://evil.example", **headers}
        r = httpx.post(server.local_url + DRAIN, headers=page, content=content)
        assert_error(r, 403, "cross_origin_forbidden")
        # Even a browser that sent no Origin: the content type alone is refused.
        r = httpx.post(server.local_url + DRAIN, headers=headers, content=content)
        assert_error(r, 415, "unsupported_media_type")
        assert server.status() == "ready"


def test_foreign_origins_are_refused_even_with_cors_open_to_all():
    with Server(allowed_origins=("*", "https://console.example")) as server:
        json_post = {"Content-Type": "application/json"}
        for origin in ("http://evil.example", "null", "http://127.0.0.1:1"):
            r = httpx.post(server.local_url + DRAIN, json={},
                           headers={"Origin": origin, **json_post})
            assert_error(r, 403, "cross_origin_forbidden")
            r = httpx.get(server.local_url + "/admin/workers", headers={"Origin": origin})
            assert_error(r, 403, "cross_origin_forbidden")
        assert server.status() == "ready"
        # An origin the operator named passes (a console of their own, which sends the
        # console's header on every admin call).
        r = httpx.get(server.local_url + "/admin/workers",
                      headers={"Origin": "https://console.example", "X-Zeroserve-Admin": "1"})
        assert r.status_code == 200


def test_a_json_post_or_an_authorization_header_passes():
    with Server() as server:
        r = httpx.post(server.local_url + DRAIN, json={"deadline_s": 5})
        assert r.status_code == 200 and r.json()["action"] == "drain"
        r = httpx.post(server.local_url + "/admin/workers/fake-0/undrain",
                       headers={"Content-Type": "application/json; charset=utf-8"})
        assert r.status_code == 200 and wait_until(lambda: server.status() == "ready")
        r = httpx.post(server.local_url + DRAIN, headers=bearer("anything"))
        assert r.status_code == 200 and server.status() == "draining"


def test_dns_rebinding_reaches_no_route_of_a_loopback_gateway():
    """A page whose name now resolves to 127.0.0.1 sends its own name as Host."""
    with Server() as server:
        rebound = {"Host": f"rebound.attacker.example:{server.gw.port}"}
        for method, path in [("GET", "/admin/workers"), ("POST", DRAIN), ("GET", "/v1/models"),
                             ("POST", "/v1/completions"), ("GET", "/health"),
                             ("GET", "/metrics")]:
            r = httpx.request(method, server.local_url + path, headers=rebound, json={})
            assert_error(r, 421, "host_not_allowed")
        assert server.status() == "ready"


def test_the_console_this_gateway_served_may_operate_it():
    """/ui's own calls carry the gateway's origin: that passes under a loopback name, or under
    any name when admin keys are set (the key is then what a foreign page lacks)."""
    with Server() as server:
        own = {"Origin": server.local_url, "Content-Type": "application/json"}
        r = httpx.post(server.local_url + DRAIN, headers=own, content=b"{}")
        assert r.status_code == 200 and server.status() == "draining"
        r = httpx.get(server.local_url + "/admin/workers", headers=own)
        assert r.status_code == 200
        # A rebound page: its own name, its own origin (the Host check or the origin rule).
        name = f"rebound.attacker.example:{server.gw.port}"
        rebound = {"Host": name, "Origin": f"http://{name}", "Content-Type": "application/json"}
        r = httpx.post(server.local_url + "/admin/workers/fake-0/undrain", headers=rebound)
        assert r.status_code in (403, 421) and server.status() == "draining"
    with Server(allowed_hosts=("*",)) as server:  # a gateway that answers any name
        name = f"rebound.attacker.example:{server.gw.port}"
        rebound = {"Host": name, "Origin": f"http://{name}", "Content-Type": "application/json"}
        r = httpx.post(server.local_url + DRAIN, headers=rebound)
        assert_error(r, 403, "cross_origin_forbidden")
        assert server.status() == "ready"
    with Server(admin_keys=(ADMIN_KEY,), allowed_hosts=("console.example",)) as server:
        name = f"console.example:{server.gw.port}"
        page = {"Host": name, "Origin": f"http://{name}", "Content-Type": "application/json"}
        r = httpx.post(server.local_url + DRAIN, headers=page)
        assert_error(r, 401, "invalid_admin_key")
        r = httpx.post(server.local_url + DRAIN, headers={**page, **bearer(ADMIN_KEY)})
        assert r.status_code == 200 and server.status() == "draining"


# --- keyless admin: the operator's token, a loopback Host and a non-simple header -------------

def admin_token() -> str:
    from zeroserve.common.admin_token import read_token

    token = read_token()
    assert token is not None  # the gateway made it at start
    return token


def test_with_api_keys_keyless_admin_needs_the_operators_token():
    """Any local process (another user, a container on the host network, a TLS terminator
    that adds no forwarding header) could drain with no key at all; now a keyless call needs
    the token in a file only the gateway's user can read, and `zeroserve` commands send it."""
    from zeroserve.common.admin_token import token_path

    with Server(host="0.0.0.0", api_keys=(API_KEY,)) as server:
        json_type = {"Content-Type": "application/json"}
        for headers in ({}, bearer(API_KEY), {"X-Zeroserve-Admin-Token": "sk-guess" * 6}):
            r = httpx.post(server.local_url + DRAIN, json={}, headers=headers)
            assert_error(r, 401, "admin_token_required")
            r = httpx.get(server.local_url + "/admin/debug/stacks",
                          headers={**json_type, **headers})
            assert_error(r, 401, "admin_token_required")
        assert str(token_path()) in r.json()["error"]["message"]
        assert server.status() == "ready"
        token = admin_token()
        assert token_path().stat().st_mode & 0o777 == 0o600
        assert token_path().parent.stat().st_mode & 0o777 == 0o700
        r = httpx.get(server.local_url + "/admin/workers",
                      headers={"X-Zeroserve-Admin-Token": token, **json_type})
        assert r.status_code == 200, r.text
        r = httpx.post(server.local_url + DRAIN, json={}, headers=bearer(token))  # the console
        assert r.status_code == 200 and server.status() == "draining"
        # ... and never from another machine, token or not.
        r = httpx.post(server.remote_url + "/admin/workers/fake-0/undrain", json={},
                       headers={"X-Zeroserve-Admin-Token": token})
        assert_error(r, 403, "admin_forbidden")


def test_keyless_admin_needs_a_loopback_host_and_a_header_no_page_can_send():
    """A gateway that answers any name (bound beyond loopback): a page rebound by DNS to
    127.0.0.1 read `GET /admin/workers` and the gateway's stacks (same origin, so no Origin
    header and no preflight). A keyless call now names a loopback Host and carries a
    non-simple header, GET included."""
    with Server(allowed_hosts=("*",)) as server:
        rebound = {"Host": f"rebound.attacker.example:{server.gw.port}",
                   "X-Zeroserve-Admin": "1"}
        for path in ("/admin/workers", "/admin/debug/stacks", "/admin/models"):
            assert_error(httpx.get(server.local_url + path, headers=rebound), 403,
                         "admin_host_forbidden")
            assert_error(httpx.get(server.local_url + path), 403, "admin_header_required")
            for header in ({"X-Zeroserve-Admin": "1"}, {"Content-Type": "application/json"}):
                assert httpx.get(server.local_url + path, headers=header).status_code == 200
        assert_error(httpx.post(server.local_url + DRAIN, json={}, headers=rebound), 403,
                     "admin_host_forbidden")
        assert server.status() == "ready"
        r = httpx.get(f"http://localhost:{server.gw.port}/admin/workers",
                      headers={"X-Zeroserve-Admin": "1"})
        assert r.status_code == 200


def test_the_cli_sends_the_token_only_to_a_loopback_gateway(monkeypatch):
    from zeroserve.cli import admin_client

    sent = []

    def urlopen(request, timeout):
        sent.append((request.full_url, request.get_header("X-zeroserve-admin-token")))
        raise OSError("not connected")

    monkeypatch.setattr(admin_client, "read_token", lambda: "t" * 43)
    monkeypatch.setattr(admin_client.urllib.request, "urlopen", urlopen)
    for url in ("http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:8000",
                "http://gateway.example:8000", "http://10.0.0.2:8000"):
        with pytest.raises(admin_client.AdminError):
            AdminClient(url).workers()
    assert [token for _, token in sent] == ["t" * 43] * 3 + [None] * 2
