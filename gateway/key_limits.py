"""Rate-limit settings: the `Limits` of one client (requests per second, burst, tokens per
minute), the defaults from the flags and the per-key limits file (JSON or TOML), whose
optional `models` table limits each client's use of one served model (`MODELS_TABLE`). The
same file names each key's and model's priority class (`priority_class`), a key's `share`
within its class, and the classes themselves (gateway/priority_classes.py): `Priorities`.
Plain data,
read when the config is built (so a bad file fails at start) and used by
gateway/http/rate_limit.py.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from zeroserve.gateway.priority_classes import (
    CLASSES_TABLE,
    DEFAULT_CLASS_FIELD,
    PriorityClasses,
    PriorityConfigError,
    check_share,
    load_classes,
)


class RateLimitConfigError(ValueError):
    pass


# Top-level names of the limits file that are not API keys.
_NOT_KEYS = frozenset({"models", CLASSES_TABLE, DEFAULT_CLASS_FIELD})
# The limits file's table of per-model limits: {"models": {"tiny": {"requests_per_second":
# 5}}} limits every client's requests to the served model `tiny` (on top of its own limits).
MODELS_TABLE = "models"


@dataclass(frozen=True)
class Limits:
    requests_per_second: float | None = None  # None: unlimited
    burst: int | None = None  # requests a client may send at once; None -> ceil(rate), >= 1
    tokens_per_minute: int | None = None  # prompt + completion tokens; None: unlimited
    max_concurrent_requests: int | None = None  # requests in flight at once; None: unlimited
    # Fair queuing (gateway/fair_queue.py): the highest class its requests are served at
    # (None: the default class), and its weight among the keys of its class (None: 1).
    priority_class: str | None = None
    share: float | None = None

    def __post_init__(self) -> None:
        rps, burst, tpm = self.requests_per_second, self.burst, self.tokens_per_minute
        concurrent = self.max_concurrent_requests
        if concurrent is not None and not (type(concurrent) is int and concurrent >= 1):
            raise RateLimitConfigError("max_concurrent_requests must be an integer >= 1")
        if rps is not None and not (_is_number(rps) and 0 < rps < math.inf):
            raise RateLimitConfigError("requests_per_second must be a number > 0")
        if burst is not None and not (type(burst) is int and burst >= 1):
            raise RateLimitConfigError("burst must be an integer >= 1")
        if tpm is not None and not (type(tpm) is int and tpm >= 1):
            raise RateLimitConfigError("tokens_per_minute must be an integer >= 1")
        if self.priority_class is not None and not isinstance(self.priority_class, str):
            raise RateLimitConfigError("priority_class must be a class name")
        if self.share is not None:
            try:
                check_share(self.share, "share")
            except PriorityConfigError as e:
                raise RateLimitConfigError(str(e)) from None

    @property
    def is_unlimited(self) -> bool:
        return (self.requests_per_second is None and self.tokens_per_minute is None
                and self.max_concurrent_requests is None)

    @property
    def request_capacity(self) -> int:
        assert self.requests_per_second is not None
        return self.burst or max(1, math.ceil(self.requests_per_second))


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def default_limits(rps: float | None, burst: int | None, tpm: int | None,
                   max_concurrent: int | None = None) -> Limits:
    return Limits(requests_per_second=rps, burst=burst, tokens_per_minute=tpm,
                  max_concurrent_requests=max_concurrent)


def load_key_limits(path: str | None, api_keys: tuple[str, ...], default: Limits
                    ) -> dict[int, Limits]:
    """Per-key limits from a JSON or TOML file (by its suffix), by the key's index in
    `api_keys`. Errors never name a key: they are secrets."""
    if path is None:
        return {}
    table = _read_table(path)
    table = {k: v for k, v in table.items() if k not in _NOT_KEYS}
    if not api_keys and table:
        raise RateLimitConfigError("per-key rate limits (--rate-limits) need API keys "
                                   "(--api-key)")
    per_key = {}
    for position, (key, entry) in enumerate(table.items(), start=1):
        where = f"{path}: entry {position}"
        if key not in api_keys:
            raise RateLimitConfigError(f"{where} is for a key that is not one of the API keys")
        per_key[api_keys.index(key)] = _limits(entry, where, default)
    return per_key


def load_model_limits(path: str | None) -> dict[str, Limits]:
    """The limits file's `models` table: served model name -> the limits of each client's
    use of it (a field left out: unlimited)."""
    if path is None:
        return {}
    models = _read_table(path).get(MODELS_TABLE, {})
    if not isinstance(models, dict):
        raise RateLimitConfigError(f"{path}: '{MODELS_TABLE}' must map model names to limits")
    return {str(name): _limits(entry, f"{path}: {MODELS_TABLE}.{name}", Limits())
            for name, entry in models.items()}


def _read_table(path: str) -> dict:
    try:
        raw = Path(path).read_bytes()
        table = tomllib.loads(raw.decode()) if path.endswith(".toml") else json.loads(raw)
    except (OSError, ValueError) as e:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise RateLimitConfigError(f"cannot read the rate limits file {path}: "
                                   f"{type(e).__name__}") from None
    if not isinstance(table, dict):
        raise RateLimitConfigError(f"{path}: must map API keys to their limits")
    return table


def _limits(entry: Any, where: str, default: Limits) -> Limits:
    names = {f.name for f in fields(Limits)}
    if not isinstance(entry, dict) or not set(entry) <= names:
        raise RateLimitConfigError(f"{where} must be an object with only "
                                   f"{', '.join(sorted(names))}")
    # TOML has no null: "unlimited" says it in both formats.
    entry = {name: None if value == "unlimited" else value for name, value in entry.items()}
    try:
        return replace(default, **entry)
    except RateLimitConfigError as e:
        raise RateLimitConfigError(f"{where}: {e}") from None


@dataclass(frozen=True)
class Priorities:
    """Who is served at which class: the classes, and the ranks and shares the limits file
    gives keys (by index in the API keys) and served models."""

    classes: PriorityClasses = PriorityClasses()
    key_ranks: tuple[tuple[int, int], ...] = ()  # (key index, rank)
    key_shares: tuple[tuple[int, float], ...] = ()  # (key index, share)
    model_ranks: tuple[tuple[str, int], ...] = ()  # (served model, rank)

    @cached_property
    def _lookups(self) -> tuple[dict, dict, dict]:  # (built once: read per request)
        return dict(self.key_ranks), dict(self.key_shares), dict(self.model_ranks)

    def ceiling(self, key: int | None, model: str | None) -> int:
        """The best rank a request of this key (None: no key) for this model may have."""
        key_ranks, _, model_ranks = self._lookups
        rank = key_ranks.get(key, self.classes.default_rank)
        if model is not None:
            rank = max(rank, model_ranks.get(model, 0))
        return rank

    def share(self, key: int | None) -> float:
        return self._lookups[1].get(key, 1.0)


def load_priorities(path: str | None, api_keys: tuple[str, ...]) -> Priorities:
    """The classes and the keys' and models' places among them, from the limits file."""
    if path is None:
        return Priorities()
    table = _read_table(path)
    try:
        classes = load_classes(table)
    except PriorityConfigError as e:
        raise RateLimitConfigError(f"{path}: {e}") from None
    per_key = load_key_limits(path, api_keys, Limits())
    per_model = load_model_limits(path)

    def rank(limits: Limits, where: str) -> int | None:
        if limits.priority_class is None:
            return None
        found = classes.rank_of(limits.priority_class)
        if found is None:
            raise RateLimitConfigError(f"{path}: {where}: priority_class must be one of "
                                       f"{', '.join(classes.names)}")
        return found

    key_ranks = tuple((i, r) for i, lim in sorted(per_key.items())
                      if (r := rank(lim, f"the entry of key {i + 1}")) is not None)
    model_ranks = tuple((m, r) for m, lim in per_model.items()
                        if (r := rank(lim, f"{MODELS_TABLE}.{m}")) is not None)
    key_shares = tuple((i, float(lim.share)) for i, lim in sorted(per_key.items())
                       if lim.share is not None)
    return Priorities(classes, key_ranks, key_shares, model_ranks)
