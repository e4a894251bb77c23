"""`zeroserve serve`: the gateway (or --gateways N of them) and N local workers, as children
of one supervisor (cli/supervisor.py) that restarts a worker which exits. Its flags are the
gateway's and the engine's, plus the supervisor's own (SUPERVISOR_OPTIONS); serve turns them
into one config per child and hands each child flags that rebuild it (child_args.py).
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
from typing import Any

import click

from zeroserve.cli.child_args import gateway_args, log_args, worker_args
from zeroserve.cli.configs import (
    engine_config,
    fetch_extra_models,
    fetch_hub_model,
    gateway_config,
    worker_config,
)
from zeroserve.cli.devices import count_cuda_devices, worker_devices
from zeroserve.cli.options import (
    ADDRESS_OPTIONS,
    ENGINE_OPTIONS,
    GATEWAY_OPTIONS,
    LOG_OPTIONS,
    MODEL_HELP,
    MODELS_OPTIONS,
    REVISION_OPTION,
    WORKER_RESILIENCE_OPTIONS,
)
from zeroserve.cli.params import env_name, option, option_group


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


# How the supervisor runs the local workers.
SUPERVISOR_OPTIONS = [
    option("--workers", type=click.IntRange(min=1), default=None,
           help="Local worker processes of --model. [default: one per CUDA GPU, else 1]"),
    option("--gateways", type=click.IntRange(min=1), default=1,
           help="Gateway processes sharing the HTTP port (SO_REUSEPORT); every worker serves "
                "them all, and one gateway's death ends only its own clients' streams."),
    option("--drain-timeout", type=click.FloatRange(min=0), default=30.0,
           help="On SIGTERM, seconds workers get to finish in-flight requests."),
    option("--worker-replace-timeout", type=click.FloatRange(min=0), default=30.0,
           help="Seconds a local worker may stay lost (no heartbeat: e.g. SIGSTOPped) or stalled "
                "(no engine progress) in the gateway's view before it is killed (SIGKILL) and "
                "restarted; 0: never."),
]


@click.command()
@SERVE_MODEL_OPTION
@option_group(MODELS_OPTIONS)
@option("--model-version", default="v1",
        help="The version label of --model's workers (an --add-model NAME@VERSION=PATH "
             "with --model's served name adds another version of it).")
@option_group(GATEWAY_OPTIONS)
@option_group(ADDRESS_OPTIONS)
@option_group(ENGINE_OPTIONS)
@option_group(SUPERVISOR_OPTIONS)
@option_group(WORKER_RESILIENCE_OPTIONS)
@option_group(LOG_OPTIONS)
def serve(**opts: Any) -> None:
    """Run the gateway and supervise N local workers (restarted with backoff if they exit).

    SIGTERM or Ctrl-C: workers drain (finish in-flight requests, up to --drain-timeout),
    then the gateway stops. Killing one worker's pid restarts just that worker.
    """
    from zeroserve.cli.children import (
        GatewayExitNotice,
        GatewayReadiness,
        GatewayWorkerWatch,
        local_url,
    )
    from zeroserve.cli.supervisor import RestartPolicy, Supervisor
    from zeroserve.common.logging_setup import setup_logging

    setup_logging(opts["log_format"], opts["log_level"])
    split_serve_models(opts)
    fetch_hub_model(opts)
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
        children = serve_children(gateways, workers, log_args=log_args(opts))
        url = local_url(gateway.host, gateway.port)
        api_key = gateway.api_keys[0] if gateway.api_keys else None
        policy = RestartPolicy(unresponsive_timeout_s=opts["worker_replace_timeout"] or None)
        admin_key = gateway.admin_keys[0] if gateway.admin_keys else None
        code = Supervisor(children, policy, readiness=GatewayReadiness(url, api_key),
                          unresponsive=GatewayWorkerWatch(url, api_key),
                          exit_notice=GatewayExitNotice(url, admin_key, len(gateways))).run()
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
    for name, version, path, num in fetch_extra_models(opts):
        version = version or "v1"
        slug = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{name}-{version}")[:100]
        for i, device in enumerate(worker_devices(opts["device"], num or 1, num_gpus)):
            groups.append((f"{slug}-{i}", name, version, path, device))
    ids = [g[0] for g in groups]
    if len(set(ids)) != len(ids):
        raise click.UsageError("--add-model: two groups of workers would share ids; give each "
                               "NAME@VERSION once")
    return groups


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
