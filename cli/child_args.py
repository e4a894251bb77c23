"""Configs -> flags: what `serve` puts on each child's command line so that `zeroserve
gateway` and `zeroserve worker` rebuild exactly the configs `serve` built (secrets excepted:
those travel in the child's environment, see serve.serve_children).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroserve.worker.config import BatchingMode, EngineConfig


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def engine_args(config: EngineConfig) -> list[str]:
    """Flags that make `zeroserve worker` build exactly this EngineConfig."""
    args = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name == "speculative_config":  # always given: off must not fall back to a default
            args += ["--speculative-config", "null" if value is None else value.to_json()]
            continue
        if value is None:
            continue
        if isinstance(value, bool):  # --enable-prefix-caching / --no-enable-prefix-caching
            args.append(_flag(f.name) if value else "--no-" + _flag(f.name)[2:])
        else:
            args += [_flag(f.name), str(value.value if isinstance(value, BatchingMode) else value)]
    return args


def worker_args(config: Any) -> list[str]:
    """Flags for `zeroserve worker` that rebuild this WorkerConfig."""
    addresses = []
    for router, tokens in config.gateway_endpoints:
        addresses += ["--router-address", router, "--tokens-address", tokens]
    dns = config.gateway_dns
    if dns is not None:
        addresses += ["--gateway-dns", dns.name, "--gateway-router-port", str(dns.router_port),
                      "--gateway-tokens-port", str(dns.tokens_port),
                      "--gateway-dns-interval", str(dns.interval_s)]
    return [
        "--worker-id", config.worker_id, *addresses, "--backend", config.backend,
        "--heartbeat-interval", str(config.heartbeat_interval_s),
        "--gateway-timeout", str(config.gateway_timeout_s),
        "--drain-timeout", str(config.drain_timeout_s),
        "--fake-forward-ms", str(config.fake_forward_s * 1000),
        "--gateway-grace", str(config.gateway_grace_s),
        "--stall-timeout", str(config.stall_timeout_s),
        "--max-step-failures", str(config.max_step_failures),
        "--served-model-name", config.served_model_name,
        "--model-version", config.model_version,
        *_security_args(config),
        *engine_args(config.engine),
    ]


def gateway_args(config: Any) -> list[str]:
    """Flags for `zeroserve gateway` that rebuild this GatewayConfig."""
    router, tokens = config.endpoints
    args = [
        "--host", config.host, "--port", str(config.port), "--model", config.model,
        "--router-address", router, "--tokens-address", tokens,
        "--credit-window", str(config.credit_window),
        "--slow-client-timeout", str(config.slow_client_timeout_s),
        "--max-queued-requests", str(config.max_queued_requests),
        "--queue-timeout", str(config.queue_timeout_s),
        "--worker-timeout", str(config.worker_timeout_s),
        "--log-format", config.log_format, "--log-level", config.log_level,
        "--min-client-rate", str(config.min_client_rate),
        "--client-send-buffer", str(config.client_send_buffer_bytes),
        "--loop-lag-warn", str(config.loop_lag_warn_s),
        "--admission-hold", str(config.admission_hold_s),
        "--request-idle-timeout", str(config.request_idle_timeout_s),
        "--worker-stall-timeout", str(config.worker_stall_timeout_s),
        "--shutdown-timeout", str(config.shutdown_timeout_s),
        "--routing", config.routing,
        "--scheduling-policy", config.scheduling_policy,
        *([] if config.max_waiting_per_worker is None
          else ["--max-waiting-per-worker", str(config.max_waiting_per_worker)]),
        *(["--reuse-port"] if config.reuse_port else []),
        *_security_args(config),
        *_input_limit_args(config),
        *_http_access_args(config),
    ]
    if config.served_model_name is not None:
        args += ["--served-model-name", config.served_model_name]
    if config.chat_template is not None:
        args += ["--chat-template", config.chat_template]
    for spec in config.extra_models:
        args += ["--add-model", spec]
    for alias in config.model_aliases:
        args += ["--model-alias", alias]
    if config.aliases_file is not None:
        args += ["--aliases-file", config.aliases_file]
    if config.reasoning_parser is not None:
        args += ["--reasoning-parser", config.reasoning_parser]
    if config.allow_extra_tool_arguments:
        args.append("--allow-extra-tool-arguments")
    if config.responses_dir is not None:
        args += ["--responses-dir", config.responses_dir]
    args += ["--response-store-size", str(config.response_store_size),
             "--response-store-ttl", str(config.response_store_ttl_s)]
    if config.otlp_traces_endpoint is not None:
        args += ["--otlp-traces-endpoint", config.otlp_traces_endpoint]
    if config.disable_metrics:
        args.append("--disable-metrics")
    if config.disable_ui:
        args.append("--disable-ui")
    if config.metrics_dir is not None:
        args += ["--metrics-dir", config.metrics_dir,
                 "--gateway-index", str(config.gateway_index)]
    return args


def _input_limit_args(config: Any) -> list[str]:
    return ["--max-request-body", str(config.max_request_body_bytes),
            "--request-body-timeout", str(config.request_body_timeout_s),
            "--header-timeout", str(config.header_timeout_s),
            "--max-tokens-limit", str(config.max_tokens_limit),
            "--max-prompt-chars", str(config.max_prompt_chars)]


def _http_access_args(config: Any) -> list[str]:
    """Everything but the API keys: those travel in the child's environment (serve_children)."""
    args = []
    for origin in config.allowed_origins:
        args += ["--allowed-origins", origin]
    for host in config.allowed_hosts:
        args += ["--allowed-hosts", host]
    for flag, value in (("--rate-limit-rps", config.rate_limit_rps),
                        ("--rate-limit-burst", config.rate_limit_burst),
                        ("--rate-limit-tpm", config.rate_limit_tpm),
                        ("--rate-limits", config.rate_limits_file)):
        if value is not None:
            args += [flag, str(value)]
    return args


def _security_args(config: Any) -> list[str]:
    args = [] if config.keys_dir is None else ["--keys-dir", config.keys_dir]
    return args + (["--insecure"] if config.insecure else [])


def log_args(opts: dict[str, Any]) -> list[str]:
    return ["--log-format", opts["log_format"], "--log-level", opts["log_level"].lower()]
