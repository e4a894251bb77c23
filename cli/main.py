"""The `zeroserve` command line: `serve` (gateway + supervised workers), `gateway`, `worker`,
and `check` (a container health check).

Every flag also reads `ZEROSERVE_<FLAG>` (dashes become underscores: `--max-num-seqs` reads
`ZEROSERVE_MAX_NUM_SEQS`); an explicit flag wins. Flags become the frozen configs
(EngineConfig, GatewayConfig, WorkerConfig); an invalid value is a usage error, never a
traceback. The `*_args` functions turn configs back into flags, which is how `serve` hands
each child process its configuration.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import click

from zeroserve.cli.debug import debug as debug_commands
from zeroserve.cli.options import (
    ADDRESS_OPTIONS,
    ENGINE_OPTIONS,
    GATEWAY_DNS_OPTIONS,
    GATEWAY_OPTIONS,
    LOG_OPTIONS,
    MODEL_HELP,
    MODEL_OPTION,
    MODELS_OPTIONS,
    REVISION_OPTION,
    WORKER_MODEL_OPTIONS,
    WORKER_PROCESS_OPTIONS,
    WORKER_RESILIENCE_OPTIONS,
)
from zeroserve.cli.params import env_name, option, option_group, positive
from zeroserve.worker.config import BatchingMode, EngineConfig


class _WholeValue(click.ParamType):
    """A string that a repeatable option reads whole from its environment variable (click
    would split it on whitespace, and a model path may hold spaces)."""

    name = "text"

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        return str(value)

    def split_envvar_value(self, rv: str) -> list[str]:
        return [rv]


# `serve` only: --model repeated serves several models on one box. The first is the default
# model (--workers workers); each further one is NAME[@VERSION]=PATH[:WORKERS] as --add-model,
# or a bare PATH served under its file or folder name with one worker.
SERVE_MODEL_OPTION = option_group([
    option("--model", "models", type=_WholeValue(), multiple=True, default=("default",),
           help=MODEL_HELP + " Repeat it to serve several models: the first is the default "
                "model (--workers workers); each further one is NAME[@VERSION]=PATH[:WORKERS] "
                "(as --add-model) or a bare PATH, served as its file or folder name with one "
                "worker."),
    REVISION_OPTION,
])


def split_serve_models(opts: dict[str, Any]) -> None:
    """`serve --model A --model B ...`: opts["model"] becomes A and the others join
    --add-model's specs (a bare PATH is named after its file or folder)."""
    models = list(opts.pop("models", None) or ("default",))
    opts["model"] = models[0]
    extra = []
    for value in models[1:]:
        name, eq, _path = value.partition("=")
        if eq and name and "/" not in name and os.sep not in name:
            extra.append(value)
            continue
        stem = pathlib.Path(value.rstrip("/\\")).name
        for suffix in (".gguf", ".GGUF"):
            stem = stem.removesuffix(suffix)
        if not stem:
            raise click.UsageError(f"--model {value!r}: cannot name it; give NAME=PATH")
        extra.append(f"{stem}={value}")
    opts["extra_models"] = tuple(extra) + tuple(opts.get("extra_models") or ())


def _fetch_hub_model(opts: dict[str, Any]) -> None:
    """A Hub model is fetched here, before anything starts; what follows (and every child of
    `serve`) gets its local path in the Hugging Face cache."""
    from zeroserve.common.model_files import ModelNotFoundError, fetch_model

    try:
        opts["model"] = fetch_model(opts["model"], opts.pop("revision", None))
    except ModelNotFoundError as e:
        raise click.ClickException(str(e)) from None



# -- flags -> configs ------------------------------------------------------------------------


def _build(cls: type, **kwargs: Any) -> Any:
    """Construct a config; its validation errors become usage errors."""
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def engine_config(opts: dict[str, Any], device: str | None = None) -> EngineConfig:
    return _build(
        EngineConfig, model=opts["model"], device=device or opts["device"],
        dtype=opts["dtype"], max_num_seqs=opts["max_num_seqs"],
        max_num_batched_tokens=opts["max_num_batched_tokens"] or max(
            EngineConfig.max_num_batched_tokens, opts["max_num_seqs"]),
        max_model_len=opts["max_model_len"], block_size=opts["block_size"],
        num_kv_blocks=opts["num_kv_blocks"], kv_cache_memory=opts["kv_cache_memory"],
        enable_prefix_caching=opts["enable_prefix_caching"],
        batching_mode=BatchingMode(opts["batching_mode"]), batch_wait_ms=opts["batch_wait_ms"],
        num_threads=opts["num_threads"], seed=opts["seed"],
        attention_backend=opts["attention_backend"],
        weight_cache=opts["weight_cache"], weight_cache_dir=opts["weight_cache_dir"],
        batch_invariant=opts["batch_invariant"],
        enforce_eager=opts["enforce_eager"], max_capture_batch_size=opts["max_capture_batch_size"],
        speculative_config=opts["speculative_config"],
    )


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
    from zeroserve.gateway.config import GatewayConfig

    if opts["otlp_traces_endpoint"] and importlib.util.find_spec("opentelemetry.sdk") is None:
        raise click.UsageError("--otlp-traces-endpoint needs the OpenTelemetry SDK: "
                               "pip install 'zeroserve[tracing]'")

    config = _build(
        GatewayConfig, host=opts["host"], port=opts["port"], model=opts["model"],
        served_model_name=opts["served_model_name"], chat_template=_chat_template(opts),
        extra_models=tuple(opts.get("extra_models") or ()),
        model_aliases=tuple(opts.get("model_aliases") or ()),
        aliases_file=opts.get("aliases_file"),
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


# -- configs -> flags (for child processes) --------------------------------------------------


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


def serve_children(gateways: list[Any], workers: list[Any], log_args: list[str]) -> list[Any]:
    """The child processes of `zeroserve serve`: the gateways (one is named "gateway",
    several "gateway-0", "gateway-1", ...), then one per worker config."""
    from zeroserve.cli.children import gateway_child_names
    from zeroserve.cli.supervisor import ChildSpec

    python = sys.executable
    specs = []
    for name, gateway in zip(gateway_child_names(len(gateways)), gateways, strict=True):
        # Secrets travel in the child's environment, never on its command line (ps shows it).
        secrets = {env_name("--admin-key"): gateway.admin_keys[0]} if gateway.admin_keys else {}
        if gateway.api_keys:
            secrets[env_name("--api-key")] = ",".join(gateway.api_keys)
        specs.append(ChildSpec(name, (python, "-m", "zeroserve.cli", "gateway",
                                      *gateway_args(gateway), *log_args),
                               stop_timeout_s=15.0, stop_phase=1, env=secrets or None))
    for config in workers:
        specs.append(ChildSpec(config.worker_id, (python, "-m", "zeroserve.cli", "worker",
                                                  *worker_args(config), *log_args),
                               stop_timeout_s=config.drain_timeout_s + 10.0, stop_phase=0))
    return specs


# -- devices ---------------------------------------------------------------------------------


def count_cuda_devices() -> int:
    """GPUs this process may use, without importing torch (the supervisor stays light)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def worker_devices(device: str, num_workers: int | None, num_gpus: int) -> list[str]:
    """One device per local worker: auto -> cuda:i when there are GPUs, else the CPU."""
    if num_workers is None:
        num_workers = max(1, num_gpus) if device in ("auto", "cuda") else 1
    if device == "auto":
        device = "cuda" if num_gpus else "cpu"
    if device == "cuda":
        if num_gpus == 0:
            raise click.UsageError("--device cuda asked for, but no CUDA device is visible")
        return [f"cuda:{i % num_gpus}" for i in range(num_workers)]
    return [device] * num_workers


# -- commands --------------------------------------------------------------------------------


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("zeroserve")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return "unknown (not installed)"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(version=_version(), prog_name="zeroserve", message="%(prog)s %(version)s")
def main() -> None:
    """zeroserve: an OpenAI-compatible LLM server (an HTTP gateway and ZeroMQ workers)."""


@main.command()
@SERVE_MODEL_OPTION
@option_group(MODELS_OPTIONS)
@option("--model-version", default="v1",
        help="The version label of --model's workers (an --add-model NAME@VERSION=PATH "
             "with --model's served name adds another version of it).")
@option_group(GATEWAY_OPTIONS)
@option_group(ADDRESS_OPTIONS)
@option_group(ENGINE_OPTIONS)
@option("--workers", type=click.IntRange(min=1), default=None,
        help="Local worker processes of --model. [default: one per CUDA GPU, else 1]")
@option("--gateways", type=click.IntRange(min=1), default=1,
        help="Gateway processes sharing the HTTP port (SO_REUSEPORT); every worker serves "
             "them all, and one gateway's death ends only its own clients' streams.")
@option("--drain-timeout", type=click.FloatRange(min=0), default=30.0,
        help="On SIGTERM, seconds workers get to finish in-flight requests.")
@option("--worker-replace-timeout", type=click.FloatRange(min=0), default=30.0,
        help="Seconds a local worker may stay lost (no heartbeat: e.g. SIGSTOPped) or stalled "
             "(no engine progress) in the gateway's view before it is killed (SIGKILL) and "
             "restarted; 0: never.")
@option_group(WORKER_RESILIENCE_OPTIONS)
@option_group(LOG_OPTIONS)
def serve(**opts: Any) -> None:
    """Run the gateway and supervise N local workers (restarted with backoff if they exit).

    SIGTERM or Ctrl-C: workers drain (finish in-flight requests, up to --drain-timeout),
    then the gateway stops. Killing one worker's pid restarts just that worker.
    """
    from zeroserve.cli.children import GatewayReadiness, GatewayWorkerWatch, local_url
    from zeroserve.cli.supervisor import RestartPolicy, Supervisor
    from zeroserve.common.logging_setup import setup_logging

    setup_logging(opts["log_format"], opts["log_level"])
    split_serve_models(opts)
    _fetch_hub_model(opts)
    num_gpus = count_cuda_devices() if opts["device"] in ("auto", "cuda") else 0
    devices = worker_devices(opts["device"], opts["workers"], num_gpus)
    worker_ids = [f"worker-{i}" for i in range(len(devices))]
    groups = extra_worker_groups(opts, num_gpus)  # --add-model's workers
    worker_ids += [worker_id for worker_id, *_ in groups]
    ephemeral_keys = _ephemeral_keys_if_needed(opts, worker_ids)
    try:
        gateways = serve_gateway_configs(opts)
        gateway = gateways[0]
        routers = tuple(g.endpoints[0] for g in gateways)
        tokens = tuple(g.endpoints[1] for g in gateways)
        opts.update(heartbeat_interval=gateway.heartbeat_interval_s,
                    gateway_timeout=max(5.0, 2 * gateway.worker_timeout_s))
        workers = [
            worker_config(opts, engine_config(opts, device=device), worker_id, routers, tokens)
            for worker_id, device in zip(worker_ids, devices, strict=False)
        ] + [
            worker_config(opts, engine_config({**opts, "model": path}, device=device), worker_id,
                          routers, tokens, name, version)
            for worker_id, name, version, path, device in groups
        ]
        children = serve_children(gateways, workers, log_args=_log_args(opts))
        url = local_url(gateway.host, gateway.port)
        api_key = gateway.api_keys[0] if gateway.api_keys else None
        policy = RestartPolicy(unresponsive_timeout_s=opts["worker_replace_timeout"] or None)
        code = Supervisor(children, policy, readiness=GatewayReadiness(url, api_key),
                          unresponsive=GatewayWorkerWatch(url, api_key)).run()
    finally:
        if ephemeral_keys is not None:
            from zeroserve.common.keys import remove

            remove(ephemeral_keys)
    sys.exit(code)


def extra_worker_groups(opts: dict[str, Any], num_gpus: int) -> list[tuple]:
    """`serve --add-model NAME[@VERSION]=PATH[:N]`: (worker id, served name, version, path,
    device) for each of its N workers (ids NAME-VERSION-i). A Hub model is fetched now and
    the gateways get its local path too."""
    groups = []
    for name, version, path, num in _fetch_extra_models(opts):
        version = version or "v1"
        slug = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{name}-{version}")[:100]
        for i, device in enumerate(worker_devices(opts["device"], num or 1, num_gpus)):
            groups.append((f"{slug}-{i}", name, version, path, device))
    ids = [g[0] for g in groups]
    if len(set(ids)) != len(ids):
        raise click.UsageError("--add-model: two groups of workers would share ids; give each "
                               "NAME@VERSION once")
    return groups


def _fetch_extra_models(opts: dict[str, Any]) -> list[tuple]:
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


def serve_gateway_configs(opts: dict[str, Any]) -> list[Any]:
    """`serve`'s gateway processes: one, or --gateways N sharing the port, each with its
    own worker-plane endpoints (given, one per gateway, or the default ipc pair of its
    index)."""
    num = opts["gateways"]
    routers, tokens = opts["router_address"], opts["tokens_address"]
    for flag, given in (("--router-address", routers), ("--tokens-address", tokens)):
        if given and len(given) != num:
            raise click.UsageError(f"{flag}: give one per gateway ({num}), not {len(given)}")
    if num == 1:
        return [gateway_config({**opts, "router_address": routers[0] if routers else None,
                                "tokens_address": tokens[0] if tokens else None})]
    from zeroserve.gateway.config import default_endpoints, tier_aliases_file, tier_metrics_dir

    aliases_file = opts.get("aliases_file") or tier_aliases_file(opts["port"])
    if not opts.get("aliases_file"):
        pathlib.Path(aliases_file).unlink(missing_ok=True)  # a last run's weights: this run's flags win
    configs = []
    for index in range(num):
        router, token = default_endpoints(opts["port"], index)
        configs.append(gateway_config({
            **opts, "reuse_port": True, "gateway_index": index, "aliases_file": aliases_file,
            "metrics_dir": opts.get("metrics_dir") or tier_metrics_dir(opts["port"]),
            "router_address": routers[index] if routers else router,
            "tokens_address": tokens[index] if tokens else token}))
    return configs


def _ephemeral_keys_if_needed(opts: dict[str, Any], worker_ids: list[str]) -> Any:
    """`serve` on tcp:// with no key set: make one for this run's own workers (a private
    temporary directory, removed at exit), so its plane is authenticated all the same."""
    addresses = [*opts["router_address"], *opts["tokens_address"]]
    if opts["keys_dir"] or opts["insecure"] or all(a.startswith("ipc://") for a in addresses):
        return None
    from zeroserve.common.keys import ephemeral

    key_dir = ephemeral(worker_ids)
    opts["keys_dir"] = str(key_dir)
    click.echo(f"tcp:// endpoints without --keys-dir: using an ephemeral key set in {key_dir}",
               err=True)
    return key_dir


@main.command()
@MODEL_OPTION
@option_group(MODELS_OPTIONS)
@option("--aliases-file", default=None, type=click.Path(dir_okay=False),
        help="A JSON file through which the gateways of a tier share alias weights changed at "
             "run time (a folder they all mount). [default: none; `serve --gateways N` sets "
             "one]")
@option_group(GATEWAY_OPTIONS)
@option_group(ADDRESS_OPTIONS)
@option_group(LOG_OPTIONS)
def gateway(**opts: Any) -> None:
    """Run only the HTTP gateway; workers connect to its --router-address/--tokens-address."""
    from zeroserve.cli.supervisor import die_with_parent
    from zeroserve.common.keys import KeySetError
    from zeroserve.common.model_files import ModelNotFoundError

    die_with_parent()  # first: a Hub download may take long, and serve may die meanwhile
    _fetch_hub_model(opts)
    _fetch_extra_models(opts)
    for flag in ("router_address", "tokens_address"):
        if len(opts[flag]) > 1:
            raise click.UsageError(f"--{flag.replace('_', '-')}: a gateway binds one address")
        opts[flag] = opts[flag][0] if opts[flag] else None
    config = gateway_config(opts)
    from zeroserve.gateway.server import run_gateway

    try:
        run_gateway(config)
    except ModelNotFoundError as e:  # the tokenizer and chat template come from the model
        raise click.ClickException(str(e)) from None
    except KeySetError as e:
        raise click.ClickException(f"cannot load the key set: {e}") from None


@main.command()
@option("--worker-id", default=None,
        help="Stable id (a restarted worker with the same id takes its place). "
             "[default: <hostname>-<pid>]")
@option_group(ADDRESS_OPTIONS)
@option("--port", type=click.IntRange(0, 65535), default=8000,
        help="The gateway's HTTP port; picks the default ipc endpoints.")
@option("--gateways", type=click.IntRange(min=1), default=1,
        help="Without addresses: serve this many local gateways on --port (the default ipc "
             "endpoints of each, as `serve --gateways N` makes them).")
@option("--fake-stamps", type=click.Path(dir_okay=False), default=None,
        help="--backend fake only, for benchmarks: at exit, write a JSON list of [first "
             "prompt token, output index, monotonic time] for every token the fake made.")
@option_group(GATEWAY_DNS_OPTIONS)
@MODEL_OPTION
@option_group(WORKER_MODEL_OPTIONS)
@option_group(ENGINE_OPTIONS)
@option_group(WORKER_PROCESS_OPTIONS)
@option_group(WORKER_RESILIENCE_OPTIONS)
@option_group(LOG_OPTIONS)
def worker(**opts: Any) -> None:
    """Run one worker: load the model once, connect to the gateway, serve until SIGTERM."""
    from zeroserve.cli.supervisor import die_with_parent

    die_with_parent()  # first: a Hub download (or torch's import) may take long
    from zeroserve.worker.omp_env import bound_omp_spinning

    bound_omp_spinning()  # before anything imports torch
    from zeroserve.common.logging_setup import setup_logging
    from zeroserve.worker.process import build_engine, run_worker

    setup_logging(opts["log_format"], opts["log_level"])
    _fetch_hub_model(opts)
    defaults = [_default_endpoints(opts["port"], i) for i in range(opts["gateways"])]
    if opts["gateway_dns"]:
        defaults = []  # gateways come from DNS
    routers = opts["router_address"] or tuple(router for router, _ in defaults)
    tokens = opts["tokens_address"] or tuple(token for _, token in defaults)
    config = worker_config(
        opts, engine_config(opts), opts["worker_id"] or f"{socket.gethostname()}-{os.getpid()}",
        routers, tokens, opts["served_model_name"], opts["model_version"],
    )
    if config.keys_dir is not None:
        from zeroserve.common.keys import KeySetError, load_worker_keys

        try:
            load_worker_keys(config.keys_dir, config.worker_id)
        except KeySetError as e:
            raise click.ClickException(f"cannot load the key set: {e}") from None
    try:
        engine = build_engine(config)
    except (OSError, ValueError) as e:  # a missing model file, an unusable device or dtype
        raise click.ClickException(f"cannot load the model: {e}") from None
    sys.exit(run_worker(config, engine=engine))


ADMIN_CLIENT_OPTIONS = [
    option("--url", default="http://127.0.0.1:8000", help="The gateway's base URL."),
    option("--admin-key", default=None,
           help="The gateway's admin key; none for a gateway on this machine without one."),
]


@main.group()
def workers() -> None:
    """Operate workers through a gateway's admin API: list, drain, undrain, restart."""


def _admin(opts: dict[str, Any]):
    from zeroserve.cli.admin_client import AdminClient

    return AdminClient(opts["url"], opts["admin_key"])


def _admin_call(call: Callable[[], Any]) -> Any:
    from zeroserve.cli.admin_client import AdminError

    try:
        return call()
    except AdminError as e:
        raise click.ClickException(str(e)) from None


@workers.command("list")
@option_group(ADMIN_CLIENT_OPTIONS)
def workers_list(**opts: Any) -> None:
    """One line per worker: id, status, load, pid, incarnation."""
    found = _admin_call(lambda: _admin(opts).workers())
    for w in found:
        click.echo(f"{w['worker_id']:<20} {w['status']:<10} running={w['num_running']} "
                   f"waiting={w['num_waiting']} paused={w['num_paused']} "
                   f"in_flight={w['num_in_flight']} pid={w['pid']} "
                   f"incarnation={w['incarnation']}")
    if not found:
        click.echo("no worker is connected")


DEADLINE_OPTION = option("--deadline", type=click.FloatRange(0, 3600), default=30.0,
                         help="Seconds in-flight streams get to finish before they move to "
                              "another worker.")


@workers.command("drain")
@click.argument("worker_id")
@DEADLINE_OPTION
@option_group(ADMIN_CLIENT_OPTIONS)
def workers_drain(worker_id: str, **opts: Any) -> None:
    """Send WORKER_ID no new work; its streams finish or move on. It stays up (undrain)."""
    _admin_call(lambda: _admin(opts).drain(worker_id, opts["deadline"]))
    click.echo(f"{worker_id}: draining")


@workers.command("undrain")
@click.argument("worker_id")
@option_group(ADMIN_CLIENT_OPTIONS)
def workers_undrain(worker_id: str, **opts: Any) -> None:
    """Let WORKER_ID take new work again."""
    _admin_call(lambda: _admin(opts).undrain(worker_id))
    click.echo(f"{worker_id}: ready for new work")


@workers.command("restart")
@click.argument("worker_id", required=False)
@option("--all", "restart_all", is_flag=True, default=False,
        help="Every worker, one at a time (rolling): the next only when the last is ready.")
@DEADLINE_OPTION
@option("--timeout", type=float, default=300.0, callback=positive,
        help="Seconds a restarted worker gets (after its drain deadline) to be ready again.")
@option_group(ADMIN_CLIENT_OPTIONS)
def workers_restart(worker_id: str | None, restart_all: bool, **opts: Any) -> None:
    """Drain WORKER_ID (or --all, rolling), let it exit and come back; wait until it is ready.

    Exits 0 only when every restarted worker is ready again as a new process.
    """
    from zeroserve.cli.admin_client import restart, rolling_restart

    if restart_all == (worker_id is not None):
        raise click.UsageError("give one WORKER_ID or --all")
    client = _admin(opts)
    if restart_all:
        ids = _admin_call(lambda: rolling_restart(client, opts["deadline"], opts["timeout"],
                                                  click.echo))
        click.echo(f"restarted {len(ids)} worker(s): {', '.join(ids)}")
        return
    _admin_call(lambda: restart(client, worker_id, opts["deadline"], opts["timeout"],
                                click.echo))


main.add_command(debug_commands)  # `zeroserve debug ...` (cli/debug.py)


@main.group()
def models() -> None:
    """Served models, their versions and workers, and aliases: list, set-weights."""


@models.command("list")
@option_group(ADMIN_CLIENT_OPTIONS)
def models_list(**opts: Any) -> None:
    """Every served model with its versions and their workers, then the aliases' weights."""
    found = _admin_call(lambda: _admin(opts).models())
    for model in found["models"]:
        names = f" (also: {', '.join(model['other_names'])})" if model["other_names"] else ""
        default = " [default]" if model["default"] else ""
        click.echo(f"{model['model']}{default}{names}")
        for version in model["versions"]:
            workers = ", ".join(f"{w['worker_id']} ({w['status']})" for w in version["workers"])
            click.echo(f"  @{version['version']:<10} {workers}")
        if not model["versions"]:
            click.echo("  no worker is connected")
    for alias in found["aliases"]:
        shares = ", ".join(f"{t} {100 * share:.1f}%" for t, share in alias["shares"].items())
        click.echo(f"alias {alias['alias']}: {shares}")


@models.command("set-weights")
@click.argument("alias")
@click.argument("weights", nargs=-1, required=True)
@option("--url", "urls", multiple=True, default=("http://127.0.0.1:8000",),
        help="A gateway's base URL; repeat it for gateways that share no aliases file (one "
             "per machine). The gateways of one `serve --gateways N` share one: any of them "
             "will do.")
@option("--admin-key", default=None,
        help="The gateways' admin key; none for a gateway on this machine without one.")
def models_set_weights(alias: str, weights: tuple[str, ...], urls: tuple[str, ...],
                       admin_key: str | None) -> None:
    """Give ALIAS these WEIGHTS from now on: TARGET=WEIGHT ... (TARGET is NAME or
    NAME@VERSION), e.g. `zeroserve models set-weights chat smollm@v1=50 smollm@v2=50`.
    Conversations whose point the change does not cover keep their version."""
    from zeroserve.cli.admin_client import AdminClient

    parsed: dict[str, float] = {}
    for item in weights:
        target, sep, weight = item.rpartition("=")
        try:
            parsed[target] = float(weight)
        except ValueError:
            sep = ""
        if not sep or not target:
            raise click.UsageError(f"{item!r} is not TARGET=WEIGHT")
    for url in urls:
        answer = _admin_call(lambda url=url: AdminClient(url, admin_key).set_weights(
            alias, parsed))
        shares = ", ".join(f"{t} {100 * share:.1f}%" for t, share in answer["shares"].items())
        click.echo(f"{url}: alias {alias}: {shares}")


@main.group()
def keys() -> None:
    """CurveZMQ key sets for the worker plane (tcp:// between gateway and workers)."""


@keys.command("generate")
@click.argument("key_dir", type=click.Path(file_okay=False))
@click.option("--worker-id", "worker_ids", multiple=True,
              help="A worker id to issue a key pair for (repeat it). [default: worker-0 to "
                   "worker-(N-1), N from --workers]")
@click.option("--workers", "num_workers", type=click.IntRange(min=1), default=2,
              show_default=True, help="How many worker-N pairs, when no --worker-id is given.")
def keys_generate(key_dir: str, worker_ids: tuple[str, ...], num_workers: int) -> None:
    """Write a gateway key pair and one key pair per worker into KEY_DIR.

    The gateway needs KEY_DIR/gateway.key_secret and KEY_DIR/workers/*.key; a worker needs
    KEY_DIR/gateway.key and its own KEY_DIR/workers/ID.key_secret. Pass --keys-dir KEY_DIR
    to both.
    """
    from zeroserve.common.keys import KeySetError, generate

    ids = list(worker_ids) or [f"worker-{i}" for i in range(num_workers)]
    try:
        path = generate(key_dir, ids)
    except KeySetError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote a gateway key pair and {len(ids)} worker key pair(s) "
               f"({', '.join(ids)}) to {path}")


@main.command()
@option("--url", default="http://127.0.0.1:8000", help="The gateway's base URL.")
@option("--live/--ready", "is_live", default=False,
        help="--live: the gateway process serves HTTP (GET /health/live), workers or not; "
             "--ready: at least one worker is ready (GET /health answers 200).")
@option("--worker-id", default=None,
        help="Check that this worker is registered and ready, not just the gateway.")
@option("--timeout", type=float, default=5.0, callback=positive, help="Seconds to wait.")
@option("--api-key", default=None,
        help="One of the gateway's API keys (the first, if a comma-separated list): with keys "
             "on, /health lists workers only to callers with one.")
def check(url: str, is_live: bool, worker_id: str | None, timeout: float,
          api_key: str | None) -> None:
    """Health check for containers: exit 0 if the gateway is live, ready, or has this worker.

    --live: GET /health/live answers 200 (for a liveness probe: a gateway with no worker yet
    is alive and must not be restarted). --ready (the default): GET /health answers 200, at
    least one worker is ready. --worker-id: /health lists that worker as ready (it said
    HELLO and keeps heartbeating).
    """
    if is_live and worker_id is not None:
        raise click.UsageError("--live checks the gateway alone; drop --worker-id")
    api_key = (api_key or "").split(",")[0].strip() or None
    status, body = _get(url.rstrip("/") + ("/health/live" if is_live else "/health"), timeout,
                        api_key)
    if is_live:
        if status != 200:
            raise click.ClickException(f"/health/live answered {status}")
        click.echo("ok: the gateway is live")
        return
    workers = body.get("workers", []) if isinstance(body, dict) else []
    if worker_id is None:
        if status != 200:
            raise click.ClickException(f"/health answered {status}: no worker is ready")
        click.echo(f"ok: {len(workers)} worker(s)")
        return
    if not isinstance(body, dict) or "workers" not in body:
        raise click.ClickException("the gateway lists workers only to callers with an API key: "
                                   "pass --api-key or set ZEROSERVE_API_KEY")
    states = {w.get("worker_id"): w.get("status") for w in workers if isinstance(w, dict)}
    if states.get(worker_id) != "ready":
        raise click.ClickException(f"worker {worker_id} is {states.get(worker_id, 'unknown')}")
    click.echo(f"ok: {worker_id} is ready")


def _get(url: str, timeout: float, api_key: str | None = None) -> tuple[int, Any]:
    """(status, parsed JSON body or None) of a GET; a ClickException if nothing answers."""
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=timeout) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    except OSError as e:
        raise click.ClickException(f"{url} does not answer: {e}") from None
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def _default_endpoints(port: int, index: int = 0) -> tuple[str, str]:
    from zeroserve.gateway.config import default_endpoints

    return default_endpoints(port, index)


def _log_args(opts: dict[str, Any]) -> list[str]:
    return ["--log-format", opts["log_format"], "--log-level", opts["log_level"].lower()]
