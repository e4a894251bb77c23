"""Flags -> the frozen configs (EngineConfig, GatewayConfig, WorkerConfig), for every command
that starts a process. A config's own validation error becomes a usage error, never a
traceback. A Hub model (--model org/name, --add-model NAME=org/name) is fetched here, before
anything starts, so that what follows gets its local path.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

import click

from zeroserve.worker.config import BatchingMode, EngineConfig


def fetch_hub_model(opts: dict[str, Any]) -> None:
    """A Hub model is fetched here, before anything starts; what follows (and every child of
    `serve`) gets its local path in the Hugging Face cache."""
    from zeroserve.common.model_files import ModelNotFoundError, fetch_model

    try:
        opts["model"] = fetch_model(opts["model"], opts.pop("revision", None))
    except ModelNotFoundError as e:
        raise click.ClickException(str(e)) from None


def fetch_extra_models(opts: dict[str, Any]) -> list[tuple]:
    """--add-model's specs parsed, each Hub model fetched now (as --model's): opts then
    hold their local paths, for the gateways (their tokenizers) and the workers."""
    from zeroserve.common.model_files import ModelNotFoundError, fetch_model
    from zeroserve.gateway.config import parse_model_spec

    parsed, specs = [], []
    for spec in opts.get("extra_models") or ():
        try:
            name, version, path, num = parse_model_spec(spec)
            path = fetch_model(path, None)
        except ValueError as e:
            raise click.UsageError(f"--add-model: {e}") from None
        except ModelNotFoundError as e:
            raise click.ClickException(str(e)) from None
        parsed.append((name, version, path, num))
        specs.append(f"{name}@{version}={path}" if version else f"{name}={path}")
    opts["extra_models"] = tuple(specs)
    return parsed


def _build(cls: type, **kwargs: Any) -> Any:
    """Construct a config; its validation errors become usage errors."""
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def engine_config(opts: dict[str, Any], device: str | None = None) -> EngineConfig:
    tier = _kv_tier_fields(opts)
    return _build(
        EngineConfig, model=opts["model"], device=device or opts["device"],
        dtype=opts["dtype"], kv_cache_dtype=opts["kv_cache_dtype"], max_num_seqs=opts["max_num_seqs"],
        max_num_batched_tokens=opts["max_num_batched_tokens"] or max(
            EngineConfig.max_num_batched_tokens, opts["max_num_seqs"]),
        max_prefill_tokens_with_decodes=opts["max_prefill_tokens_with_decodes"] or None,
        max_model_len=opts["max_model_len"], block_size=opts["block_size"],
        num_kv_blocks=opts["num_kv_blocks"], kv_cache_memory=opts["kv_cache_memory"],
        enable_prefix_caching=opts["enable_prefix_caching"],
        batching_mode=BatchingMode(opts["batching_mode"]), batch_wait_ms=opts["batch_wait_ms"],
        num_threads=opts["num_threads"], seed=opts["seed"],
        attention_backend=opts["attention_backend"],
        weight_cache=opts["weight_cache"], weight_cache_dir=opts["weight_cache_dir"],
        batch_invariant=opts["batch_invariant"], int8_activations=opts["int8_activations"],
        enforce_eager=opts["enforce_eager"], max_capture_batch_size=opts["max_capture_batch_size"],
        speculative_config=opts["speculative_config"],
        **tier,
    )


def _kv_tier_fields(opts: dict[str, Any]) -> dict[str, Any]:
    """The KV tier's fields: its flags, with --kv-transfer-config (vLLM's JSON) read onto
    them (cli/kv_transfer_config.py)."""
    names = ("kv_offloading_size", "kv_offloading_dir", "kv_tier_dir", "kv_tier_dir_size",
             "kv_pool_in_tier")
    flags = {name: opts[name] for name in names}
    text = opts.get("kv_transfer_config")
    if not text:
        return flags
    from zeroserve.cli.kv_transfer_config import (
        KVTransferConfigError,
        merge_with_flags,
        parse_kv_transfer_config,
    )

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name in names}
    try:
        return merge_with_flags(parse_kv_transfer_config(text, opts["block_size"]), flags,
                                defaults)
    except KVTransferConfigError as e:
        raise click.BadParameter(str(e), param_hint="'--kv-transfer-config'") from None


def _chat_template(opts: dict[str, Any]) -> str | None:
    """--chat-template, checked now (readable, compiles) and made absolute for children."""
    path = opts.get("chat_template")
    if path is None:
        return None
    from zeroserve.gateway.text.chat_template import ChatTemplateError, read_template_file

    try:
        read_template_file(path)
    except ChatTemplateError as e:
        raise click.UsageError(f"--chat-template: {e}") from None
    return os.path.abspath(path)


def gateway_config(opts: dict[str, Any]):
    from zeroserve.gateway.config import GatewayConfig, tier_class_shares_file

    if opts["otlp_traces_endpoint"] and importlib.util.find_spec("opentelemetry.sdk") is None:
        raise click.UsageError("--otlp-traces-endpoint needs the OpenTelemetry SDK: "
                               "pip install 'zeroserve[tracing]'")

    config = _build(
        GatewayConfig, host=opts["host"], port=opts["port"], model=opts["model"],
        served_model_name=opts["served_model_name"], chat_template=_chat_template(opts),
        extra_models=tuple(opts.get("extra_models") or ()),
        model_aliases=tuple(opts.get("model_aliases") or ()),
        aliases_file=opts.get("aliases_file"),
        class_shares_file=tier_class_shares_file(opts["port"]),
        router_address=opts["router_address"],
        tokens_address=opts["tokens_address"], credit_window=opts["credit_window"],
        slow_client_timeout_s=opts["slow_client_timeout"],
        max_queued_requests=opts["max_queued_requests"], queue_timeout_s=opts["queue_timeout"],
        worker_timeout_s=opts["worker_timeout"], log_format=opts["log_format"],
        log_level=opts["log_level"].lower(),
        min_client_rate=opts["min_client_rate"], loop_lag_warn_s=opts["loop_lag_warn"],
        admission_hold_s=opts["admission_hold"],
        client_send_buffer_bytes=opts["client_send_buffer"],
        request_idle_timeout_s=opts["request_idle_timeout"],
        worker_stall_timeout_s=opts["worker_stall_timeout"], routing=opts["routing"],
        scheduling_policy=opts["scheduling_policy"],
        max_waiting_per_worker=opts["max_waiting_per_worker"],
        shutdown_timeout_s=opts["shutdown_timeout"],
        reuse_port=opts["reuse_port"],
        keys_dir=opts["keys_dir"], insecure=opts["insecure"],
        admin_keys=(opts["admin_key"],) if opts["admin_key"] else (),
        otlp_traces_endpoint=opts["otlp_traces_endpoint"],
        disable_metrics=opts["disable_metrics"], disable_ui=opts["disable_ui"],
        metrics_dir=opts.get("metrics_dir"), gateway_index=opts.get("gateway_index", 0),
        reasoning_parser=opts.get("reasoning_parser"),
        allow_extra_tool_arguments=opts.get("allow_extra_tool_arguments", False),
        responses_dir=opts.get("responses_dir"),
        response_store_size=opts.get("response_store_size", 1000),
        response_store_ttl_s=opts.get("response_store_ttl", 24 * 3600.0),
        **_input_limits(opts),
        **_http_access(opts),
    )
    _check_aliases(config)
    return config


def _check_aliases(config: Any) -> None:
    """--model-alias: well formed, and naming only served models (a usage error now rather
    than a gateway that fails to start)."""
    from zeroserve.common.model_files import model_display_name
    from zeroserve.gateway.config import parse_model_spec
    from zeroserve.gateway.workers.models import ModelCatalog, parse_alias

    display = model_display_name(config.model)
    default = config.served_model_name or display
    names = {default: default, display: default}
    for spec in config.extra_models:
        names.setdefault(parse_model_spec(spec)[0], parse_model_spec(spec)[0])
    try:
        ModelCatalog(default, names, [parse_alias(a) for a in config.model_aliases])
    except ValueError as e:
        raise click.UsageError(f"--model-alias: {e}") from None


def _http_access(opts: dict[str, Any]) -> dict[str, Any]:
    keys = list(opts["api_keys"])
    if opts["api_key_file"] is not None:
        try:
            with open(opts["api_key_file"], encoding="utf-8") as lines:
                keys += [k.strip() for k in lines if k.strip() and not k.startswith("#")]
        except (OSError, UnicodeDecodeError) as e:
            raise click.UsageError(f"cannot read --api-key-file: {e}") from None
    return dict(api_keys=tuple(dict.fromkeys(keys)), allowed_origins=opts["allowed_origins"],
                allowed_hosts=opts["allowed_hosts"], rate_limit_rps=opts["rate_limit_rps"],
                rate_limit_burst=opts["rate_limit_burst"], rate_limit_tpm=opts["rate_limit_tpm"],
                rate_limits_file=opts["rate_limits_file"])


def _input_limits(opts: dict[str, Any]) -> dict[str, Any]:
    return dict(max_request_body_bytes=opts["max_request_body"],
                request_body_timeout_s=opts["request_body_timeout"],
                header_timeout_s=opts["header_timeout"],
                max_tokens_limit=opts["max_tokens_limit"],
                max_prompt_chars=opts["max_prompt_chars"])


def worker_config(opts: dict[str, Any], engine: EngineConfig, worker_id: str,
                  router_address: str | tuple[str, ...],
                  tokens_address: str | tuple[str, ...], served_model_name: str = "",
                  model_version: str | None = None):
    """One gateway's addresses as strings (as ever), several as tuples."""
    from zeroserve.worker.config import WorkerConfig

    def one_or_many(addresses: str | tuple[str, ...]) -> str | tuple[str, ...]:
        return addresses[0] if isinstance(addresses, tuple) and len(addresses) == 1 else addresses

    return _build(
        WorkerConfig, worker_id=worker_id, router_address=one_or_many(router_address),
        tokens_address=one_or_many(tokens_address), engine=engine, backend=opts["backend"],
        heartbeat_interval_s=opts["heartbeat_interval"],
        gateway_timeout_s=opts["gateway_timeout"], drain_timeout_s=opts["drain_timeout"],
        fake_forward_s=opts["fake_forward_ms"] / 1000, gateway_grace_s=opts["gateway_grace"],
        stall_timeout_s=opts["stall_timeout"], max_step_failures=opts["max_step_failures"],
        keys_dir=opts["keys_dir"], insecure=opts["insecure"],
        fake_stamps_path=opts.get("fake_stamps"), gateway_dns=_gateway_dns(opts),
        served_model_name=served_model_name,
        model_version=model_version or opts.get("model_version") or "v1",
    )


def _gateway_dns(opts: dict[str, Any]):
    if not opts.get("gateway_dns"):
        return None
    from zeroserve.worker.discovery import GatewayDns

    return _build(GatewayDns, name=opts["gateway_dns"], router_port=opts["gateway_router_port"],
                  tokens_port=opts["gateway_tokens_port"],
                  interval_s=opts["gateway_dns_interval"])
