"""`zeroserve workers ...` and `zeroserve models ...`: operate a running gateway through its
admin API (cli/admin_client.py): list, drain, undrain and restart workers; list models and
set an alias's weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from zeroserve.cli.params import option, option_group, positive

ADMIN_CLIENT_OPTIONS = [
    option("--url", default="http://127.0.0.1:8000", help="The gateway's base URL."),
    option("--admin-key", default=None,
           help="The gateway's admin key; none for a gateway on this machine without one."),
]


@click.group()
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
                   f"incarnation={w['incarnation']}" + _kv_tier_text(w.get("kv_tier")))
    if not found:
        click.echo("no worker is connected")


def _kv_tier_text(tier: dict | None) -> str:
    """The box's KV tier as `workers list` shows it: blocks loaded from it, lookups missed,
    MiB written; nothing with the tier off."""
    if not tier:
        return ""
    return (f" tier_hits={tier.get('hits', 0)} tier_misses={tier.get('misses', 0)} "
            f"tier_written_mib={tier.get('written_bytes', 0) / 2**20:.0f}")


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


@click.group()
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


@click.group("classes")
def classes() -> None:
    """The gateway queue's priority classes: list, set-share."""


def _echo_classes(url: str, found: dict) -> None:
    click.echo(f"{url}: policy {found['policy']}, at most {found['max_queued']} queued")
    for c in found["classes"]:
        default = " [default]" if c["default"] else ""
        click.echo(f"  {c['name']:<12} share {c['share']:g}, queue {c['queue_fraction']:g}, "
                   f"queued {c['num_queued']}, shed {c['num_shed']}{default}")


@classes.command("list")
@option_group(ADMIN_CLIENT_OPTIONS)
def classes_list(**opts: Any) -> None:
    """Each class, most important first: its share, queue fraction, requests queued, shed."""
    _echo_classes(opts["url"], _admin_call(lambda: _admin(opts).classes()))


@classes.command("set-share")
@click.argument("name")
@click.argument("share", type=float)
@option("--url", "urls", multiple=True, default=("http://127.0.0.1:8000",),
        help="A gateway's base URL; repeat it for each gateway (a share is each gateway's "
             "own, until it restarts and reads the limits file again).")
@option("--admin-key", default=None,
        help="The gateways' admin key; none for a gateway on this machine without one.")
def classes_set_share(name: str, share: float, urls: tuple[str, ...],
                      admin_key: str | None) -> None:
    """Give class NAME this SHARE of the queue's service from now on, e.g.
    `zeroserve classes set-share sheddable 0.5`."""
    from zeroserve.cli.admin_client import AdminClient

    for url in urls:
        _echo_classes(url, _admin_call(
            lambda url=url: AdminClient(url, admin_key).set_share(name, share)))
