"""`zeroserve check`: --live passes on a gateway with no worker, --ready (the default) does not."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tests.cli.stub_gateway import StubGateway
from zeroserve.cli import main as cli


@pytest.fixture
def stub():
    s = StubGateway()
    yield s
    s.close()


def check(*args: str):
    return CliRunner().invoke(cli.main, ["check", *args], env={})


def test_live_passes_without_workers_ready_does_not(stub):
    stub.health_status = 503
    assert check("--url", stub.url, "--live").exit_code == 0
    failed = check("--url", stub.url)  # --ready is the default
    assert failed.exit_code == 1 and "no worker is ready" in failed.output
    assert check("--url", stub.url, "--ready").exit_code == 1


def test_ready_and_worker_id(stub):
    stub.health["workers"] = [{"worker_id": "worker-0", "status": "ready", "pid": 1}]
    assert check("--url", stub.url, "--ready").exit_code == 0
    assert check("--url", stub.url, "--worker-id", "worker-0").exit_code == 0
    missing = check("--url", stub.url, "--worker-id", "worker-1")
    assert missing.exit_code == 1 and "unknown" in missing.output


def test_live_fails_when_nothing_answers():
    result = check("--url", "http://127.0.0.1:1", "--live", "--timeout", "1")
    assert result.exit_code == 1 and "does not answer" in result.output


def test_live_with_a_worker_id_is_a_usage_error(stub):
    result = check("--url", stub.url, "--live", "--worker-id", "worker-0")
    assert result.exit_code == 2 and "Traceback" not in result.output
