"""`zeroserve worker`: one worker process, for docker compose and Kubernetes (and for `serve`,
which starts each of its workers so): load the model once, connect to the gateways, serve
until SIGTERM."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

import click

from zeroserve.cli.configs import engine_config, fetch_hub_model, worker_config
from zeroserve.cli.options import (
    ADDRESS_OPTIONS,
    ENGINE_OPTIONS,
    GATEWAY_DNS_OPTIONS,
    LOG_OPTIONS,
    MODEL_OPTION,
    WORKER_MODEL_OPTIONS,
    WORKER_PROCESS_OPTIONS,
    WORKER_RESILIENCE_OPTIONS,
)
from zeroserve.cli.params import option, option_group
from zeroserve.worker import cpu_class


@click.command()
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
@option("--cpu-class", type=click.Choice(cpu_class.names(), case_sensitive=False),
        default=cpu_class.NATIVE,
        help="Cap what the worker believes about the CPU (at most what it has): the dtype "
             "auto chooses, the kernels, the native kernels' build and torch's oneDNN/ATen "
             "instruction sets all follow this class; native is what the CPU says.")
@option_group(LOG_OPTIONS)
def worker(**opts: Any) -> None:
    """Run one worker: load the model once, connect to the gateway, serve until SIGTERM."""
    from zeroserve.cli.supervisor import die_with_parent

    die_with_parent()  # first: a Hub download (or torch's import) may take long
    from zeroserve.worker.omp_env import bound_omp_spinning

    bound_omp_spinning()  # before anything imports torch
    if opts["cpu_class"].lower() != cpu_class.NATIVE or cpu_class.ENV_VAR in os.environ:
        os.environ[cpu_class.ENV_VAR] = opts["cpu_class"].lower()  # the flag wins
    cpu_class.apply_to_environment()  # oneDNN's and ATen's caps, also before torch
    from zeroserve.common.logging_setup import setup_logging
    from zeroserve.worker.process import build_engine, run_worker

    setup_logging(opts["log_format"], opts["log_level"])
    fetch_hub_model(opts)
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


def _default_endpoints(port: int, index: int = 0) -> tuple[str, str]:
    from zeroserve.gateway.config import default_endpoints

    return default_endpoints(port, index)
