"""The Host check against DNS rebinding (gateway/http/host_check.py): loopback names only on a
loopback-bound gateway by default, `--allowed-hosts` added, IPv6 literals with ports."""

from __future__ import annotations

import socket

import httpx
import pytest
from starlette.datastructures import Headers

from tests.gateway.helpers import GatewayServer
from zeroserve.gateway.http.host_check import AllowedHosts, host_header, host_name


@pytest.mark.parametrize("header,name", [
    ("localhost:8000", "localhost"), ("API.Example:443", "api.example"),
    ("api.example.", "api.example"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
    ("[FD00::2]:80", "fd00::2"), ("::1", "::1"), ("[::1", "[::1"), ("", ""),
])
def test_host_name(header, name):
    assert host_name(header) == name


@pytest.mark.parametrize("headers", [
    [(b"host", b"localhost:8000")], [], [(b"accept", b"*/*")],
    [(b"x-host", b"a"), (b"host", b"first.example"), (b"host", b"second.example")],
    [(b"host", "caf\u00e9.example".encode("latin-1"))], [(b"host", b"")],
])
def test_the_host_header_is_read_as_starlette_reads_it(headers):
    scope = {"type": "http", "headers": headers}
    assert host_header(scope) == Headers(scope=scope).get("host")


def test_answers_stay_right_past_the_memo_of_known_names():
    hosts = AllowedHosts.for_server("127.0.0.1", ("api.example",))
    for k in range(1000):  # more names than the memo holds: it starts over, answers hold
        assert not hosts.allows(f"name-{k}.example")
        assert hosts.allows("api.example:443") and hosts.allows(f"127.0.0.{k % 250 + 1}")
    assert len(hosts._known) <= 256


def test_a_loopback_bound_gateway_answers_loopback_names_only():
    hosts = AllowedHosts.for_server("127.0.0.1", ())
    for header in ("localhost:8000", "127.0.0.1:8000", "127.0.0.2", "[::1]:8000", "[::1]",
                   "LOCALHOST"):
        assert hosts.allows(header), header
    for header in ("attacker.example:8000", "192.168.1.5:8000", "[fd00::2]:8000",
                   "localhost.attacker.example", "127.0.0.1.nip.io", ""):
        assert not hosts.allows(header), header
    assert AllowedHosts.for_server("::1", ()) is not None
    assert AllowedHosts.for_server("localhost", ()) is not None


def test_other_binds_answer_any_name_unless_told():
    assert AllowedHosts.for_server("0.0.0.0", ()) is None
    assert AllowedHosts.for_server("", ()) is None
    assert AllowedHosts.for_server("127.0.0.1", ("*",)) is None  # the operator's opt-out
    hosts = AllowedHosts.for_server("0.0.0.0", ("api.example", "*.internal.example",
                                                "[fd00::2]", "::3"))
    for header in ("api.example", "API.EXAMPLE:443", "a.internal.example:8000",
                   "[fd00::2]:8000", "[::3]:1", "localhost:8000", "[::1]:8000"):
        assert hosts.allows(header), header
    for header in ("internal.example", "api.example.evil", "[fd00::3]:8000", "evil.example"):
        assert not hosts.allows(header), header


def test_allowed_hosts_with_ipv6_literals_on_a_real_server():
    """`--allowed-hosts '[fd00::2]'` matched no request before: the port was cut at the
    first colon of "[fd00::2]:8000"."""
    with GatewayServer(host="0.0.0.0", allowed_hosts=("[fd00::2]",)) as gw:
        for host in (f"[fd00::2]:{gw.port}", "[fd00::2]", f"[::1]:{gw.port}"):
            assert httpx.get(gw.url + "/v1/models", headers={"Host": host}).status_code \
                == 200, host
        r = httpx.get(gw.url + "/v1/models", headers={"Host": f"[fd00::3]:{gw.port}"})
        assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed"


def test_a_gateway_on_ipv6_loopback_answers_its_own_address():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    with GatewayServer(host="::1", uvicorn_overrides={"host": "::1"}) as gw:
        url = f"http://[::1]:{gw.port}"
        assert httpx.get(url + "/v1/models").status_code == 200  # Host: [::1]:PORT
        r = httpx.get(url + "/v1/models", headers={"Host": "rebound.attacker.example"})
        assert r.status_code == 421
