"""What the gateway's queue did, per priority class and per key, for `/metrics`
(gateway/observability/fairness_metrics.py): requests queued now, how long they waited,
how many were shed (refused, or displaced by a higher class in a full queue).

Label cardinality is bounded: classes are the configured ones (at most 16); a key is labelled
by its index among the API keys (`key-0`, `key-1`, ...: never the key itself), the first
MAX_KEY_LABELS of them, and `other` beyond; clients without keys (by address) share one label,
`anonymous`. Plain data.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

MAX_KEY_LABELS = 64
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                120.0)  # gateway/observability/fairness_metrics.py exposes the same


def key_label(client: Hashable) -> str:
    if type(client) is int:
        return f"key-{client}" if client < MAX_KEY_LABELS else "other"
    return "anonymous"


@dataclass
class _Figures:
    num_queued: int = 0
    num_shed: int = 0
    num_served: int = 0
    wait_sum_s: float = 0.0
    wait_count: int = 0
    # Cumulative per WAIT_BUCKETS bound (+Inf last), for the per-class histogram.
    buckets: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS) + 1))

    def observe(self, wait_s: float) -> None:
        self.wait_sum_s += wait_s
        self.wait_count += 1
        self.buckets[bisect_left(WAIT_BUCKETS, wait_s)] += 1


class QueueStats:
    def __init__(self, class_names: tuple[str, ...]) -> None:
        self.class_names = class_names
        self.by_class = [_Figures() for _ in class_names]
        self.by_key: dict[str, _Figures] = {}  # at most MAX_KEY_LABELS + 2 labels
        self.shares: dict[int, float] = {}  # shares changed at run time, by rank

    def _key(self, client: Hashable) -> _Figures:
        label = key_label(client)
        figures = self.by_key.get(label)
        if figures is None:
            figures = self.by_key[label] = _Figures()
        return figures

    def on_queued(self, rank: int, client: Hashable) -> None:
        self.by_class[rank].num_queued += 1
        self._key(client).num_queued += 1

    def on_left(self, rank: int, client: Hashable, wait_s: float, is_served: bool) -> None:
        for figures in (self.by_class[rank], self._key(client)):
            figures.num_queued -= 1
            if is_served:
                figures.num_served += 1
                figures.observe(wait_s)

    def on_shed(self, rank: int, client: Hashable, num_requests: int = 1) -> None:
        self.by_class[rank].num_shed += num_requests
        self._key(client).num_shed += num_requests

    def on_displaced(self, rank: int, client: Hashable) -> None:
        """A queued request lost its place to a higher class's (it leaves unserved later)."""
        self.on_shed(rank, client)

    def current_shares(self, classes: Any) -> list[float]:
        return [self.shares.get(rank, c.share) for rank, c in enumerate(classes.classes)]
