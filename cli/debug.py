"""`zeroserve debug stacks|profile|memory|torch-profile`: a live look inside a gateway or one
of its workers, through the gateway's admin API (gateway/http/debug.py). Readable text by
default, the gateway's JSON with --json; --output FILE writes it to a file instead."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

from zeroserve.cli.admin_client import AdminClient, AdminError
from zeroserve.common.introspection import (
    MAX_HZ,
    MAX_MEMORY_SECONDS,
    MAX_PROFILE_SECONDS,
    MEMORY_ACTIONS,
    format_memory,
    format_stacks,
    format_top,
)


def _common(fn: Callable) -> Callable:
    for decorator in reversed([
        click.option("--url", default="http://127.0.0.1:8000", envvar="ZEROSERVE_URL",
                     show_default=True, show_envvar=True, help="The gateway's base URL."),
        click.option("--admin-key", default=None, envvar="ZEROSERVE_ADMIN_KEY",
                     show_envvar=True, help="The gateway's admin key; none for a gateway on "
                                            "this machine without one."),
        click.option("--worker", "worker_id", default=None,
                     help="A worker's id (`zeroserve workers list`); without it, the gateway "
                          "process itself."),
        click.option("--json", "as_json", is_flag=True, default=False,
                     help="Print the gateway's JSON answer."),
        click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True),
                     default=None, help="Write the output to this file instead."),
    ]):
        fn = decorator(fn)
    return fn


def _seconds(default: float, limit: float) -> Callable:
    return click.option("--seconds", type=click.FloatRange(0.01, limit), default=default,
                        show_default=True, help="How long to sample (the call takes as long).")


@click.group()
def debug() -> None:
    """A live look inside the gateway or a worker (admin API): stacks, profiles, memory."""


@debug.command("stacks")
@_common
def debug_stacks(**opts: Any) -> None:
    """Every thread's Python stack now (and the gateway's asyncio tasks). A worker answers
    from its I/O thread, so this works while its engine is hung."""
    answer = _call(opts, "stacks", {})
    _emit(opts, answer, format_stacks)


@debug.command("profile")
@_common
@_seconds(5.0, MAX_PROFILE_SECONDS)
@click.option("--hz", type=click.IntRange(1, MAX_HZ), default=100, show_default=True,
              help="Samples a second.")
@click.option("--format", "output_format", type=click.Choice(["top", "collapsed"]),
              default="top", show_default=True,
              help="top: functions by self and total samples; collapsed: `a;b;c N` lines for "
                   "flamegraph.pl, speedscope or inferno.")
@click.option("--limit", type=click.IntRange(1, 200), default=40, show_default=True,
              help="Rows of the top table.")
@click.option("--thread", default=None,
              help="Only threads whose name starts with this (a worker's engine loop: "
                   "MainThread).")
def debug_profile(**opts: Any) -> None:
    """A CPU profile of N seconds: a sampling profiler over every thread's Python stack,
    and the CPU time each thread used meanwhile."""
    args = {"seconds": opts["seconds"], "hz": opts["hz"], "limit": opts["limit"]}
    if opts["thread"]:
        args["thread"] = opts["thread"]
    answer = _call(opts, "profile", args, opts["seconds"])
    _emit(opts, answer, format_top if opts["output_format"] == "top"
          else lambda a: a["collapsed"])


@debug.command("memory")
@_common
@_seconds(5.0, MAX_MEMORY_SECONDS)
@click.option("--action", type=click.Choice(MEMORY_ACTIONS), default="diff",
              show_default=True,
              help="diff: trace allocations for --seconds and show what grew (then stop); "
                   "start: a baseline, tracing stays on; snapshot: what grew since start; "
                   "stop: tracing off.")
@click.option("--limit", type=click.IntRange(1, 200), default=25, show_default=True,
              help="How many allocation sites.")
@click.option("--frames", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Traceback depth per allocation (at start); sites group by it.")
def debug_memory(**opts: Any) -> None:
    """The top allocation sites since a baseline (tracemalloc, started on demand)."""
    args = {"action": opts["action"], "seconds": opts["seconds"], "limit": opts["limit"],
            "frames": opts["frames"]}
    wait_s = opts["seconds"] if opts["action"] == "diff" else 0.0
    _emit(opts, _call(opts, "memory", args, wait_s), format_memory)


@debug.command("torch-profile")
@_common
@_seconds(5.0, MAX_PROFILE_SECONDS)
def debug_torch_profile(**opts: Any) -> None:
    """The torch profiler around a worker's engine steps for N seconds; --output FILE saves
    the chrome trace (chrome://tracing, ui.perfetto.dev)."""
    if opts["worker_id"] is None:
        raise click.UsageError("the torch profiler runs in a worker: give --worker ID")
    answer = _call(opts, "torch-profile", {"seconds": opts["seconds"]}, opts["seconds"])
    if opts["output"] is not None and not opts["as_json"]:
        if answer.get("trace") is None:
            raise click.ClickException(f"the trace is too large to send; it is on the "
                                       f"worker's machine at {answer['path']}")
        _write(opts["output"], json.dumps(answer["trace"]))
        click.echo(f"wrote the chrome trace ({answer['trace_bytes']} bytes, "
                   f"{answer['num_iterations']} engine iterations) to {opts['output']}")
        return
    _emit(opts, answer, lambda a: (
        f"# {a['worker_id']}: {a['seconds']}s, {a['num_iterations']} engine iterations; "
        f"the chrome trace ({a['trace_bytes']} bytes) is at {a['path']} on the worker's "
        "machine (--output FILE saves it here)\n"))


def _call(opts: dict[str, Any], kind: str, args: dict, wait_s: float = 0.0) -> dict:
    client = AdminClient(opts["url"], opts["admin_key"])
    try:
        return client.debug(kind, opts["worker_id"], args, wait_s)
    except AdminError as e:
        raise click.ClickException(str(e)) from None


def _emit(opts: dict[str, Any], answer: dict, as_text: Callable[[dict], str]) -> None:
    text = json.dumps(answer, indent=2) + "\n" if opts["as_json"] else as_text(answer)
    if opts["output"] is None:
        click.echo(text, nl=False)
    else:
        _write(opts["output"], text)
        click.echo(f"wrote {len(text)} characters to {opts['output']}", err=True)


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise click.ClickException(f"cannot write {path}: {e}") from None
