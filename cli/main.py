"""The `zeroserve` command line, the entry point (`zeroserve.cli.main:main`): the group and
its commands, each in a module of its own:

- serve.py: `serve`, the gateway and supervised local workers;
- gateway.py, worker.py: `gateway` and `worker`, one part each (compose, Kubernetes);
- admin.py: `workers ...`, `models ...` and `classes ...` against a running gateway's admin API;
- debug.py: `debug ...`, a live look inside a gateway or a worker;
- keys.py: `keys generate`; check.py: `check`, a container health check.

The flags come from params.py (option, the types) and options.py (the option groups);
configs.py turns them into the frozen configs, child_args.py turns configs back into the
flags `serve` hands its children. Nothing of the product imports this package.
"""

from __future__ import annotations

import click

from zeroserve.cli.admin import classes, models, workers
from zeroserve.cli.check import check
from zeroserve.cli.debug import debug
from zeroserve.cli.gateway import gateway
from zeroserve.cli.keys import keys
from zeroserve.cli.params import env_name
from zeroserve.cli.serve import serve
from zeroserve.cli.worker import worker

__all__ = ["env_name", "main"]  # env_name: the tests of compose and Kubernetes read it here


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


main.add_command(serve)
main.add_command(gateway)
main.add_command(worker)
main.add_command(workers)
main.add_command(models)
main.add_command(classes)
main.add_command(debug)
main.add_command(keys)
main.add_command(check)
