"""`zeroserve gateway`: only the HTTP gateway, for docker compose and Kubernetes; workers
connect to its --router-address/--tokens-address."""

from __future__ import annotations

from typing import Any

import click

from zeroserve.cli.configs import fetch_extra_models, fetch_hub_model, gateway_config
from zeroserve.cli.options import (
    ADDRESS_OPTIONS,
    GATEWAY_OPTIONS,
    LOG_OPTIONS,
    MODEL_OPTION,
    MODELS_OPTIONS,
)
from zeroserve.cli.params import option, option_group


@click.command()
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
    fetch_hub_model(opts)
    fetch_extra_models(opts)
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
