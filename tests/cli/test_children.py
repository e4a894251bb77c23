"""`serve`'s readiness probe against a stub gateway: ready means our own pid, seen ready."""

from __future__ import annotations

import pytest

from tests.cli.stub_gateway import StubGateway
from zeroserve.cli.children import GatewayReadiness, local_url


@pytest.fixture
def stub():
    s = StubGateway()
    yield s
    s.close()


def test_gateway_ready_only_with_our_pid(stub):
    probe = GatewayReadiness(stub.url)
    assert probe({"gateway": 100}) == {"gateway"}
    assert probe({"gateway": 101}) == set()  # someone else holds the port
    stub.live = None
    assert probe({"gateway": 100}) == set()


def test_workers_ready_by_id_and_pid_even_on_a_503(stub):
    stub.health_status = 503
    stub.health["workers"] = [
        {"worker_id": "worker-0", "status": "ready", "pid": 7},
        {"worker_id": "worker-1", "status": "ready", "pid": 8},  # an earlier incarnation
        {"worker_id": "worker-2", "status": "draining", "pid": 9},
        "junk",
    ]
    probe = GatewayReadiness(stub.url)
    pids = {"gateway": 100, "worker-0": 7, "worker-1": 18, "worker-2": 9}
    assert probe(pids) == {"gateway", "worker-0"}


def test_nothing_listening_is_nothing_ready():
    probe = GatewayReadiness(local_url("127.0.0.1", 1))
    assert probe({"gateway": 1, "worker-0": 2}) == set()


@pytest.mark.parametrize("host,url", [
    ("0.0.0.0", "http://127.0.0.1:8000"), ("", "http://127.0.0.1:8000"),
    ("::", "http://[::1]:8000"), ("10.0.0.5", "http://10.0.0.5:8000"),
])
def test_local_url(host, url):
    assert local_url(host, 8000) == url
