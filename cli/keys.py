"""`zeroserve keys generate`: CurveZMQ key sets for the worker plane (common/keys.py)."""

from __future__ import annotations

import click


@click.group()
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
