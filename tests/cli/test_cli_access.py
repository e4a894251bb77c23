"""The HTTP access flags (API keys, CORS, hosts, rate limits): flags and variables become the
gateway's config, and `serve` hands them to its gateway child with the keys in its
environment, never on its command line."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_cli import captured, invoke  # noqa: F401 (a fixture)


def test_access_defaults_are_open(captured):  # noqa: F811
    assert invoke(["gateway"]).exit_code == 0
    config = captured["gateway"]
    assert config.api_keys == () and config.allowed_origins == () and config.allowed_hosts == ()
    assert config.rate_limit_rps is None and config.rate_limit_tpm is None


def test_keys_from_flags_variable_and_file(captured, tmp_path):  # noqa: F811
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nsk-file-1\n\nsk-file-2\nsk-flag\n")
    result = invoke(["gateway", "--api-key", "sk-flag", "--api-key", "sk-a,sk-b",
                     "--api-key-file", str(key_file)])
    assert result.exit_code == 0, result.output
    assert captured["gateway"].api_keys == ("sk-flag", "sk-a", "sk-b", "sk-file-1",
                                            "sk-file-2")
    assert invoke(["gateway"], env={"ZEROSERVE_API_KEY": "sk-x, sk-y"}).exit_code == 0
    assert captured["gateway"].api_keys == ("sk-x", "sk-y")


def test_origins_hosts_and_rate_limits(captured, tmp_path):  # noqa: F811
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"sk-a": {"requests_per_second": 1}}))
    result = invoke(["gateway", "--allowed-origins", '["https://a.example", "https://b.example"]',
                     "--allowed-hosts", "api.example,*.internal.example",
                     "--rate-limit-rps", "2.5", "--rate-limit-tpm", "1000",
                     "--rate-limits", str(limits)],
                    env={"ZEROSERVE_API_KEY": "sk-a"})
    assert result.exit_code == 0, result.output
    config = captured["gateway"]
    assert config.allowed_origins == ("https://a.example", "https://b.example")
    assert config.allowed_hosts == ("api.example", "*.internal.example")
    assert config.rate_limit_rps == 2.5 and config.rate_limit_tpm == 1000
    assert config.rate_limits_file == str(limits)


@pytest.mark.parametrize("args,env", [
    (["--api-key", "has space"], {}),
    (["--allowed-origins", "example.com"], {}),
    (["--allowed-hosts", "a.*.example"], {}),
    (["--rate-limit-rps", "0"], {}),
    (["--rate-limit-burst", "3"], {}),  # a burst without a rate
    (["--allowed-origins", '["unclosed"'], {}),
])
def test_bad_access_values_are_usage_errors(captured, args, env):  # noqa: F811
    result = invoke(["gateway", *args], env=env)
    assert result.exit_code == 2 and "gateway" not in captured
    assert "Traceback" not in result.output and "has space" not in result.output


def test_rate_limits_file_for_an_unknown_key_is_a_usage_error(captured, tmp_path):  # noqa: F811
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"sk-secret-typo": {"requests_per_second": 1}}))
    result = invoke(["gateway", "--api-key", "sk-a", "--rate-limits", str(limits)])
    assert result.exit_code == 2 and "not one of the API keys" in result.output
    assert "sk-secret-typo" not in result.output


def test_serve_passes_keys_in_the_environment_only(captured, monkeypatch):  # noqa: F811
    result = invoke(["serve", "--device", "cpu", "--backend", "fake", "--api-key", "sk-a,sk-b",
                     "--allowed-origins", "https://a.example", "--rate-limit-rps", "3"])
    assert result.exit_code == 0, result.output
    gateway_spec, *worker_specs = captured["children"]
    assert not any("sk-a" in arg for spec in captured["children"] for arg in spec.argv)
    assert gateway_spec.env["ZEROSERVE_API_KEY"] == "sk-a,sk-b"
    assert all(spec.env is None or "ZEROSERVE_API_KEY" not in spec.env
               for spec in worker_specs)
    # The child rebuilds the same config from its flags and its environment.
    result = invoke(list(gateway_spec.argv[3:]), env=gateway_spec.env)
    assert result.exit_code == 0, result.output
    config = captured["gateway"]
    assert config.api_keys == ("sk-a", "sk-b")
    assert config.allowed_origins == ("https://a.example",) and config.rate_limit_rps == 3.0
