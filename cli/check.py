"""`zeroserve check`: a container health check against a gateway (live, ready, or has this
worker), in plain urllib so that it starts fast."""

from __future__ import annotations

import json
from typing import Any

import click

from zeroserve.cli.params import option, positive


@click.command()
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
