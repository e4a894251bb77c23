"""`zeroserve worker --gateway-dns NAME`: the flags build a WorkerConfig that finds its
gateways by DNS, refuse mixing with fixed addresses, and survive `worker_args` (the flags a
supervisor passes to a child)."""

from __future__ import annotations

from tests.cli.test_cli import captured, invoke  # noqa: F401 (a fixture)
from zeroserve.cli.child_args import worker_args
from zeroserve.worker.discovery import GatewayDns


def test_gateway_dns_flags_build_the_config(captured):  # noqa: F811
    result = invoke(["worker", "--worker-id", "worker-3", "--gateway-dns", "gateway-plane",
                     "--gateway-router-port", "6000", "--gateway-tokens-port", "6001",
                     "--gateway-dns-interval", "2", "--backend", "fake", "--insecure"])
    assert result.exit_code == 0, result.output
    config = captured["worker"]
    assert config.gateway_dns == GatewayDns("gateway-plane", 6000, 6001, 2.0)
    assert config.gateway_endpoints == []  # no fixed address, not even the ipc default
    args = worker_args(config)
    assert args[args.index("--gateway-dns") + 1] == "gateway-plane"
    assert args[args.index("--gateway-tokens-port") + 1] == "6001"


def test_the_environment_gives_the_name_as_kubernetes_does(captured):  # noqa: F811
    result = invoke(["worker", "--backend", "fake", "--insecure"],
                    env={"ZEROSERVE_GATEWAY_DNS": "gateway-plane",
                         "ZEROSERVE_WORKER_ID": "worker-0"})
    assert result.exit_code == 0, result.output
    assert captured["worker"].gateway_dns.name == "gateway-plane"
    assert captured["worker"].worker_id == "worker-0"


def test_bad_gateway_dns_settings_are_usage_errors(captured):  # noqa: F811
    for args, message in (
            (["--gateway-dns", "gw", "--router-address", "tcp://a:1", "--tokens-address",
              "tcp://a:2"], "not both"),
            (["--gateway-dns", "gw:5555"], "host name"),
            (["--gateway-dns", "gw", "--gateway-router-port", "7", "--gateway-tokens-port", "7"],
             "must differ"),
            (["--gateway-dns", "gw"], "CurveZMQ")):
        insecure = [] if message == "CurveZMQ" else ["--insecure"]
        result = invoke(["worker", "--backend", "fake", *insecure, *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)
        assert "worker" not in captured
