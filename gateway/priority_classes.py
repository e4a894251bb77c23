"""Priority classes: the named levels a request is served at, as the limits file sets them.

- The classes, most important first, come from the limits file's `classes` table
  (`{"classes": {"critical": {"share": 8}, "standard": {"share": 4}, "sheddable": {"share":
  1, "queue_fraction": 0.5}}}`, in that order) or are these three by default. A class's
  `share` is its weight when the gateway's queue serves the classes (weighted fair queuing:
  gateway/fair_queue.py); its `queue_fraction` is how much of the queue (`--max-queued-requests`)
  it may fill before it is refused (lower classes are refused first when the queue is deep).
- A request's class is its key's (`priority_class` in the key's entry of the limits file),
  lowered by its model's (`priority_class` in the `models` table), else the default class
  (`default_class`, else `standard` when named, else the first).
- A request may ask for a lower class, never a higher one: vLLM's `priority` field (lower is
  served first; an integer p asks for the class of rank p relative to the default class, so
  with the default classes -1 is critical, 0 standard, 1 sheddable) or a class's name.
- On the wire (SUBMIT.priority) a class travels as its rank relative to the default class:
  0 for the default class, so the common case costs nothing (common/protocol.py).

Plain data, read when the config is built (so a bad file fails at start).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from zeroserve.common.protocol import MAX_PRIORITY

CLASSES_TABLE = "classes"
DEFAULT_CLASS_FIELD = "default_class"
MAX_CLASSES = 16
MAX_SHARE = 1_000_000.0


class PriorityConfigError(ValueError):
    pass


@dataclass(frozen=True)
class PriorityClass:
    name: str
    share: float = 1.0  # weight among the classes that have requests waiting
    queue_fraction: float = 1.0  # of --max-queued-requests this class may fill

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and 0 < len(self.name) <= 64
                and self.name.replace("-", "").replace("_", "").isalnum()):
            raise PriorityConfigError("class names must be 1 to 64 letters, digits, - or _")
        check_share(self.share, f"class {self.name!r}: share")
        q = self.queue_fraction
        if not (type(q) in (int, float) and 0 < q <= 1):
            raise PriorityConfigError(f"class {self.name!r}: queue_fraction must be in (0, 1]")


def check_share(share: Any, what: str) -> float:
    if not (type(share) in (int, float) and 0 < share <= MAX_SHARE and math.isfinite(share)):
        raise PriorityConfigError(f"{what} must be a number in (0, {MAX_SHARE:g}]")
    return float(share)


DEFAULT_CLASSES = (PriorityClass("critical", 8.0), PriorityClass("standard", 4.0),
                   PriorityClass("sheddable", 1.0, 0.5))


@dataclass(frozen=True)
class PriorityClasses:
    """The classes, most important first (rank 0), and the default one's rank."""

    classes: tuple[PriorityClass, ...] = DEFAULT_CLASSES
    default_rank: int = 1

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if not 1 <= len(names) <= MAX_CLASSES or len(set(names)) != len(names):
            raise PriorityConfigError(f"1 to {MAX_CLASSES} classes with distinct names")
        if not 0 <= self.default_rank < len(names):
            raise PriorityConfigError("the default class must be one of the classes")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

    def rank_of(self, name: str) -> int | None:
        for rank, c in enumerate(self.classes):
            if c.name == name:
                return rank
        return None

    def wire_priority(self, rank: int) -> int:
        """SUBMIT.priority of a class: its rank relative to the default class."""
        return max(-MAX_PRIORITY, min(MAX_PRIORITY, rank - self.default_rank))

    def requested_rank(self, requested: int | str | None) -> int | None:
        """The rank a request's `priority` asks for (None: it asks for nothing); an unknown
        name is None too (the schema refused it before)."""
        if requested is None:
            return None
        if isinstance(requested, str):
            return self.rank_of(requested)
        return max(0, min(len(self.classes) - 1, self.default_rank + requested))

    def effective_rank(self, ceiling: int, requested: int | str | None) -> int:
        """A request's class: what it asks for, but never above `ceiling` (its key's)."""
        asked = self.requested_rank(requested)
        return ceiling if asked is None else max(ceiling, asked)


def load_classes(table: dict) -> PriorityClasses:
    """The limits file's `classes` table and `default_class` (both optional)."""
    raw = table.get(CLASSES_TABLE)
    classes = DEFAULT_CLASSES
    if raw is not None:
        if not isinstance(raw, dict) or not raw:
            raise PriorityConfigError(f"'{CLASSES_TABLE}' must map class names to "
                                      "{share, queue_fraction}, most important first")
        built = []
        for name, entry in raw.items():
            entry = {} if entry is None else entry
            if not isinstance(entry, dict) or not set(entry) <= {"share", "queue_fraction"}:
                raise PriorityConfigError(f"class {name!r} must be an object with only "
                                          "share, queue_fraction")
            built.append(PriorityClass(str(name), **entry))
        classes = tuple(built)
    names = [c.name for c in classes]
    default = table.get(DEFAULT_CLASS_FIELD)
    if default is None:
        default = "standard" if "standard" in names else names[0]
    if default not in names:
        raise PriorityConfigError(f"'{DEFAULT_CLASS_FIELD}' must name one of the classes "
                                  f"({', '.join(names)})")
    return PriorityClasses(classes, names.index(default))
