"""The pieces every `zeroserve` flag is made of: `option` (a click option that also reads
`ZEROSERVE_<FLAG>`), `option_group` (a list of options applied as one decorator), and the
parameter types and callbacks the option groups share (sizes, lists, devices, positives,
the speculative config).

Every flag also reads `ZEROSERVE_<FLAG>` (dashes become underscores: `--max-num-seqs` reads
`ZEROSERVE_MAX_NUM_SEQS`); an explicit flag wins.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any

import click

from zeroserve.worker.speculative import SpeculativeConfig

ENV_PREFIX = "ZEROSERVE_"
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def env_name(flag: str) -> str:
    """'--max-num-seqs' -> 'ZEROSERVE_MAX_NUM_SEQS'."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def option(*decls: str, **kwargs: Any) -> Callable:
    """click.option with its ZEROSERVE_<FLAG> variable set explicitly (click's automatic
    prefix would add the command name: ZEROSERVE_SERVE_PORT)."""
    flag = next(d for d in decls if d.startswith("--")).split("/")[0]
    kwargs.setdefault("envvar", env_name(flag))
    kwargs.setdefault("show_envvar", True)
    kwargs.setdefault("show_default", True)
    return click.option(*decls, **kwargs)


def field_default(cls: type, name: str) -> Any:
    """The default of a config dataclass field, shown as the flag's default."""
    return {f.name: f.default for f in dataclasses.fields(cls)}[name]


class ByteSize(click.ParamType):
    """'4GiB', '512MiB', '1.5GB', '1000000' -> bytes."""

    name = "bytes"
    _UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
              "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
              "tib": 2**40}

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = match and self._UNITS.get(match.group(2).lower())
        if not match or unit is None:
            self.fail(f"{value!r} is not a size (examples: 4GiB, 512MiB, 1000000)", param, ctx)
        size = int(float(match.group(1)) * unit)
        if size < 1:
            self.fail(f"{value!r} must be at least one byte", param, ctx)
        return size


def check_device(ctx: Any, param: Any, value: str) -> str:
    if not _DEVICE_RE.match(value):
        raise click.BadParameter(f"{value!r}: use auto, cpu, cuda or cuda:N")
    return value


def positive(ctx: Any, param: Any, value: float | None) -> float | None:
    if value is not None and value <= 0:
        raise click.BadParameter("must be > 0")
    return value


class ListItem(click.ParamType):
    """One or more values: repeat the flag, or separate them with commas (also in the
    ZEROSERVE_* variable: ZEROSERVE_API_KEY=key1,key2); a JSON list as vLLM takes it
    (--allowed-origins '["*"]') works too. See list_values."""

    name = "text"
    envvar_list_splitter = ","


def list_values(ctx: Any, param: Any, values: tuple[str, ...] | None) -> tuple[str, ...]:
    items: list[str] = []
    for value in values or ():
        value = value.strip()
        if value.startswith("["):
            try:
                parsed = json.loads(value)
            except ValueError:
                raise click.BadParameter("not a JSON list of strings") from None
            if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
                raise click.BadParameter("not a JSON list of strings")
            items += parsed
        else:
            items += value.split(",")
    return tuple(dict.fromkeys(item.strip() for item in items if item.strip()))


def option_group(decorators: list[Callable]) -> Callable:
    """Several options as one decorator, in the order listed (the order --help shows)."""

    def apply(fn: Callable) -> Callable:
        for decorator in reversed(decorators):
            fn = decorator(fn)
        return fn

    return apply


def speculative_config(ctx: click.Context, param: click.Parameter,
                       value: str | None) -> SpeculativeConfig | None:
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    try:
        return SpeculativeConfig.from_json(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None

