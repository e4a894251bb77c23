"""The gateway's HTTP input limit flags: defaults, variables, validation, and `serve` handing
them to its gateway child."""

from __future__ import annotations

import pytest

from tests.cli.test_cli import captured, invoke  # noqa: F401 (a fixture)


def test_input_limit_defaults_and_flags(captured):  # noqa: F811
    assert invoke(["gateway"]).exit_code == 0
    config = captured["gateway"]
    assert config.max_request_body_bytes == 8 * 1024 * 1024
    assert config.request_body_timeout_s == 30.0 and config.header_timeout_s == 10.0
    assert config.max_tokens_limit == 4096 and config.max_prompt_chars == 1_000_000
    result = invoke(["gateway", "--max-request-body", "1MiB", "--header-timeout", "2",
                     "--request-body-timeout", "5", "--max-tokens-limit", "100"],
                    env={"ZEROSERVE_MAX_PROMPT_CHARS": "5000"})
    assert result.exit_code == 0, result.output
    config = captured["gateway"]
    assert config.max_request_body_bytes == 2 ** 20 and config.header_timeout_s == 2.0
    assert config.request_body_timeout_s == 5.0 and config.max_tokens_limit == 100
    assert config.max_prompt_chars == 5000


@pytest.mark.parametrize("args", [["--max-request-body", "100"], ["--header-timeout", "0"],
                                  ["--max-tokens-limit", "0"], ["--request-body-timeout", "-1"]])
def test_bad_input_limits_are_usage_errors(captured, args):  # noqa: F811
    result = invoke(["gateway", *args])
    assert result.exit_code == 2 and "gateway" not in captured


def test_serve_passes_the_limits_to_its_gateway(captured):  # noqa: F811
    result = invoke(["serve", "--device", "cpu", "--backend", "fake", "--max-tokens-limit",
                     "77", "--max-request-body", "65536", "--header-timeout", "3"])
    assert result.exit_code == 0, result.output
    gateway_spec = captured["children"][0]
    assert invoke(list(gateway_spec.argv[3:])).exit_code == 0
    config = captured["gateway"]
    assert config.max_tokens_limit == 77 and config.max_request_body_bytes == 65536
    assert config.header_timeout_s == 3.0


def test_scheduling_policy_and_worker_queue_flags_reach_the_gateway_child(captured):  # noqa: F811
    assert invoke(["gateway"]).exit_code == 0
    config = captured["gateway"]
    assert config.scheduling_policy == "fair" and config.max_waiting_per_worker is None
    result = invoke(["serve", "--device", "cpu", "--backend", "fake", "--scheduling-policy",
                     "fcfs", "--max-waiting-per-worker", "2"])
    assert result.exit_code == 0, result.output
    assert invoke(list(captured["children"][0].argv[3:])).exit_code == 0
    config = captured["gateway"]
    assert config.scheduling_policy == "fcfs" and config.max_waiting_per_worker == 2
    assert invoke(["gateway", "--scheduling-policy", "lottery"]).exit_code == 2
