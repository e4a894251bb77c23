"""Which workers may serve a request's `model`: served models, their versions, and aliases.

The data model:

    served model name -> versions -> workers        (what workers announce in HELLO)
    alias             -> [(target, weight), ...]    (the operator's; weights change live)

A worker announces the served name of its model and a version label (`--served-model-name`,
`--model-version`; an empty name means the gateway's default model). The gateway serves the
models it was told to (`--model`, `--add-model`: their tokenizers live in gateway/text/) and
refuses a worker of any other. A request's `model` resolves to a `Target`:

- a served model's name (or another name of it): any worker of that model;
- `NAME@VERSION`: only that version's workers;
- an alias: one of its targets by weight. With a sticky key (the client's `user`,
  `prompt_cache_key` or session header) the key is hashed to a point in [0, 1) and the
  target whose cumulative weight covers it is taken, so one conversation always gets the
  same version while the weights stay (and its prefix cache keeps working); a move of
  weights moves only the conversations whose point the change covers. Without a key: a
  weighted random pick.

Once a stream is on a worker it is pinned to that worker's (model, version): failover and
resubmission (gateway/core.py) pick only workers of the same pair, so a stream never
continues on another model or version than it started on.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from zeroserve.gateway.logging import get_logger
from zeroserve.gateway.workers.alias_file import AliasFile

log = get_logger("models")

MAX_ALIAS_TARGETS = 16
# Weights are relative; a bound keeps their sum finite (1e308 twice is inf, and every share
# 0) and makes 10**400 in a file or a call a clear refusal rather than an OverflowError.
MAX_ALIAS_WEIGHT = 1_000_000


class UnknownModel(LookupError):
    """A request named a model this gateway does not serve (the API answers 404)."""


@dataclass(frozen=True)
class Target:
    """The workers a request may run on: those of `model`, of `version` only if given."""

    model: str
    version: str | None = None

    def matches(self, model: str, version: str) -> bool:
        return model == self.model and (self.version is None or version == self.version)

    def pinned(self, version: str) -> Target:
        """This target narrowed to one version (a stream's, once it runs)."""
        return self if self.version is not None else Target(self.model, version)

    def __str__(self) -> str:
        return self.model if self.version is None else f"{self.model}@{self.version}"


def parse_target(text: str) -> Target:
    """`NAME` or `NAME@VERSION` (names as clients send them; checked by the catalog)."""
    name, sep, version = text.strip().rpartition("@")
    if not sep:
        name, version = version, ""
    if not name or (sep and not version):
        raise ValueError(f"{text!r} is not NAME or NAME@VERSION")
    return Target(name, version or None)


def stable_point(key: str) -> float:
    """A conversation's key -> a point in [0, 1), the same in every gateway process."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass(frozen=True)
class Alias:
    """A name spread over targets by weight (weights are relative; 0 takes none)."""

    name: str
    weights: tuple[tuple[Target, float], ...]

    def __post_init__(self) -> None:
        if not 0 < len(self.weights) <= MAX_ALIAS_TARGETS:
            raise ValueError(f"alias {self.name!r} needs 1 to {MAX_ALIAS_TARGETS} targets")
        if any(not 0 <= w <= MAX_ALIAS_WEIGHT for _, w in self.weights):  # NaN fails too
            raise ValueError(f"alias {self.name!r}: weights must be finite numbers >= 0 and "
                             f"at most {MAX_ALIAS_WEIGHT:,}")
        if sum(w for _, w in self.weights) <= 0:
            raise ValueError(f"alias {self.name!r}: some weight must be above 0")
        targets = [t for t, _ in self.weights]
        if len(set(targets)) != len(targets):
            raise ValueError(f"alias {self.name!r} names a target twice")

    def pick(self, key: str | None, rng: random.Random | None = None) -> Target:
        """The target for a request: by the key's point when it has one, else at random."""
        point = stable_point(key) if key else (rng or random).random()
        total = sum(w for _, w in self.weights)
        cumulative = 0.0
        for target, weight in self.weights:
            cumulative += weight / total
            if point < cumulative and weight > 0:
                return target
        return next(t for t, w in reversed(self.weights) if w > 0)  # rounding at the top

    def shares(self) -> dict[str, float]:
        """Each target's share of requests, summing to 1 (for listings)."""
        total = sum(w for _, w in self.weights)
        return {str(t): w / total for t, w in self.weights}

    def describe(self) -> dict:
        return {"alias": self.name, "weights": {str(t): w for t, w in self.weights},
                "shares": {t: round(s, 6) for t, s in self.shares().items()}}


def parse_alias(spec: str) -> Alias:
    """`ALIAS=TARGET:WEIGHT,TARGET:WEIGHT` (`--model-alias chat=smollm@v1:90,smollm@v2:10`);
    a target without `:WEIGHT` weighs 1."""
    name, sep, rest = spec.partition("=")
    if not sep or not name.strip() or not rest.strip():
        raise ValueError(f"alias {spec!r} must be ALIAS=TARGET:WEIGHT,...")
    weights = []
    for part in rest.split(","):
        target, colon, weight = part.strip().rpartition(":")
        if not colon:
            target, weight = weight, "1"
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"alias {name!r}: weight {weight!r} is not a number") from None
        weights.append((parse_target(target), value))  # "1e400" is inf: Alias refuses it
    return Alias(name.strip(), tuple(weights))


def alias_from_weights(name: str, weights: Mapping[str, object]) -> Alias:
    """An admin call's `{"smollm@v1": 90, "smollm@v2": 10}` -> an Alias (ValueError if bad)."""
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError("'weights' must be an object of target -> weight")
    pairs = []
    for target, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"the weight of {target!r} must be a number")
        if isinstance(weight, int) and weight > MAX_ALIAS_WEIGHT:  # float(10**400) overflows
            raise ValueError(f"alias {name!r}: the weight of {target!r} must be at most "
                             f"{MAX_ALIAS_WEIGHT:,}")
        pairs.append((parse_target(str(target)), float(weight)))
    return Alias(name, tuple(pairs))


class ModelCatalog:
    """The models a gateway serves, their other names, and its aliases.

    `names` maps every name a client may use for a served model (its served name, and for
    the default model also its file's display name) to the served name. Alias weights may
    be replaced at run time (`set_alias`); `shared` (an AliasFile) carries replacements to
    every gateway of a tier.
    """

    def __init__(self, default: str, names: Mapping[str, str], aliases: Iterable[Alias] = (),
                 shared: AliasFile | None = None):
        self.default = default
        self.names = dict(names)
        self.names.setdefault(default, default)
        self.served = tuple(dict.fromkeys(self.names.values()))
        # Targets by served name only (an alias may name the file's display name); replaced
        # whole, never changed in place, so that a reader's iteration never sees it change.
        self.aliases: dict[str, Alias] = {}
        for alias in aliases:
            alias = self._canonical(alias)
            self.aliases = {**self.aliases, alias.name: alias}
        self.shared = shared
        if shared is not None:
            self.refresh(force=True)

    # --- workers ------------------------------------------------------------------------

    def model_of_worker(self, announced: str) -> str | None:
        """The served model a worker's HELLO name means ("" = the default); None: unknown."""
        return self.default if not announced else self.names.get(announced)

    # --- requests -----------------------------------------------------------------------

    def resolve(self, requested: str | None, key: str | None = None,
                rng: random.Random | None = None) -> Target:
        """A request's `model` (None: the default) -> its target; UnknownModel if unserved."""
        if requested is None:
            return Target(self.default)
        served = self.names.get(requested)
        if served is not None:
            return Target(served)
        if self.aliases or self.shared is not None:
            self.refresh()
            alias = self.aliases.get(requested)
            if alias is not None:
                return alias.pick(key, rng)  # its targets are served names (_canonical)
        if "@" in requested:
            try:
                target = parse_target(requested)
            except ValueError:
                raise UnknownModel(requested) from None
            served = self.names.get(target.model)
            if served is not None:
                return Target(served, target.version)
        raise UnknownModel(requested)

    def is_known(self, name: str) -> bool:
        try:
            self.resolve(name, key="")
        except UnknownModel:
            return False
        return True

    def describe(self, workers: Iterable[tuple[str, str, str, str]]) -> dict:
        """The listing `zeroserve models list` prints: every served model with its versions
        and their workers ((model, version, worker id, status) each), then the aliases."""
        versions: dict[str, dict[str, list[dict]]] = {name: {} for name in self.served}
        for model, version, worker_id, status in workers:
            versions.setdefault(model, {}).setdefault(version, []).append(
                {"worker_id": worker_id, "status": status})
        other_names = {}
        for name, served in self.names.items():
            if name != served:
                other_names.setdefault(served, []).append(name)
        models = [{"model": name, "default": name == self.default,
                   "other_names": sorted(other_names.get(name, [])),
                   "versions": [{"version": v, "workers": sorted(ws, key=lambda w: w["worker_id"])}
                                for v, ws in sorted(by_version.items())]}
                  for name, by_version in versions.items()]
        self.refresh()
        return {"models": models,
                "aliases": [alias.describe() for _, alias in sorted(self.aliases.items())]}

    # --- aliases --------------------------------------------------------------------------

    def set_alias(self, alias: Alias) -> Alias:
        """Replace (or add) an alias's weights here and, through the shared file, in every
        gateway of the tier; the alias as it now stands (its targets by served name).
        ValueError if it names an unserved model or shadows one; OSError if the shared file
        cannot be written (nothing changes then)."""
        alias = self._canonical(alias)
        if self.shared is not None:
            # Under the file's lock: this alias changes, every other stays as the file has
            # it now (another gateway's change of a moment ago included).
            self._take(self.shared.update(alias.name, alias.describe()["weights"]))
        self.aliases = {**self.aliases, alias.name: alias}
        return alias

    def refresh(self, force: bool = False) -> None:
        """Take the tier's latest weights (cheap: the file is looked at twice a second)."""
        if self.shared is None:
            return
        changed = self.shared.read_if_changed(force)
        if changed is not None:
            self._take(changed)

    def _take(self, found: Mapping[str, object]) -> None:
        """The aliases of the tier's file; one that is bad here is left out with a warning
        (its weights out of bounds, or naming models another gateway serves and this one
        does not), and what this gateway had for it stays."""
        taken = {}
        for name, weights in found.items():
            try:
                taken[name] = self._canonical(alias_from_weights(name, weights))
            except ValueError as e:
                log.warning("an alias in the aliases file is left out: %s", e,
                            extra={"path": str(self.shared.path) if self.shared else None})
        if taken:
            self.aliases = {**self.aliases, **taken}

    def _canonical(self, alias: Alias) -> Alias:
        """`alias` with each target by its served name (a client may call a model by another
        name: the default model's file's display name); ValueError if it cannot serve."""
        if alias.name in self.names or "@" in alias.name:
            raise ValueError(f"alias {alias.name!r} would hide a served model's name")
        weights = []
        for target, weight in alias.weights:
            served = self.names.get(target.model)
            if served is None:
                raise ValueError(f"alias {alias.name!r}: {target.model!r} is not a served "
                                 f"model (served: {', '.join(self.served)})")
            weights.append((Target(served, target.version), weight))
        return Alias(alias.name, tuple(weights))  # names one target twice: ValueError
