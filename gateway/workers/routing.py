"""Routing: which of the workers that can take a request gets it.

- `least_loaded`: the worker with the fewest requests in flight (ties: more free KV blocks).
- `cache_aware` (default): the worker that already holds the longest prefix of the prompt in
  its prefix cache (or, less, in the box's KV tier it shares: below), as long as that keeps
  its load within its bound (below);
  a prompt no worker holds goes by rendezvous hashing on its first block the gateway has not
  seen, within the same bound; when nobody is within the bound, the least loaded.

What a worker holds is the gateway's estimate, not the worker's word: every worker keeps an
LRU index (`PrefixIndex`) of the chained hashes of the full KV blocks of the prompts routed
to it, bounded by its KV pool size (more could not be cached there). A worker's prefix cache
hashes full blocks the same way (a block is reusable only after the same whole chain), so
the turns of one chat (each prompt extends the last) and requests sharing a system prompt
find the worker that computed their K/V. A restarted worker is a new `WorkerHandle` with an
empty index.

Bounded loads (consistent hashing with bounded loads, Mirrokni et al.): worker w may take
one more request while load_w + 1 <= ceil(LOAD_BOUND * (total + 1) * capacity_w / total
capacity) + LOAD_SLACK, so no worker runs more than about 25% above its share of the
requests in flight (plus one, so that a few chats are not split up for nothing),
however skewed the prefixes are.

The box's KV tier (worker/kv_tier/): workers whose HELLO names the same tier load each
other's blocks from it, so a prefix any of them was sent is cheap on all of them, though
dearer than in a worker's own pool (a load from host memory or disk, not nothing). The router
keeps one more LRU index per tier (bounded by the tier's blocks, and kept across the restarts
of its workers, as the tier keeps the blocks) and scores a worker by the prompt blocks it
would not compute: a block in its own pool counts 1, one only in its tier 1 -
TIER_BLOCK_COST, a miss 0. So own pool > tier > miss, within the same load bound.

Rendezvous hashing (highest random weight) uses a stable hash of the worker id, so another
gateway process in front of the same workers, or this one after a restart, sends a new
prefix to the same worker.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from zeroserve.gateway.config import RoutingPolicy
from zeroserve.gateway.workers.handle import WorkerHandle
from zeroserve.gateway.workers.prefix import Prefix, PrefixIndex

LOAD_BOUND = 1.25
LOAD_SLACK = 1
# What loading a block from the box's KV tier costs, against computing it. Measured on CPU
# (issue 37) it is well under 1% (252 us to load and verify a default-model block, tens of
# ms to compute it); a GPU computes faster and copies from host memory slower, so this stays
# far above that: a tier hit is always worth much more than a miss and less than a pool hit.
TIER_BLOCK_COST = 0.25
MAX_TIERS = 256  # tier indexes kept (ids come from accepted HELLOs)
MAX_TIER_INDEX_BLOCKS = 1 << 20  # a tier index's bound, whatever its tier holds (~100 MB)


def load_of(worker: WorkerHandle) -> int:
    """Requests in flight on a worker: what it reported plus what we sent since, or what we
    know we sent it, whichever is more."""
    return max(worker.load, len(worker.request_ids))


def least_loaded(candidates: Sequence[WorkerHandle]) -> WorkerHandle:
    return min(candidates, key=lambda w: (load_of(w), -w.num_free_blocks, w.worker_id))


def rendezvous_weight(key: int | str, worker_id: str) -> int:
    digest = hashlib.blake2b(f"{key}/{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def within_bound(candidates: Sequence[WorkerHandle]) -> list[WorkerHandle]:
    """The workers that may take one more request without exceeding LOAD_BOUND x their
    share (by capacity) of the requests in flight, plus LOAD_SLACK."""
    loads = [load_of(w) for w in candidates]
    total_load = sum(loads) + 1
    total_capacity = sum(w.capacity for w in candidates) or 1
    return [w for w, load in zip(candidates, loads, strict=True)
            if load + 1 <= math.ceil(LOAD_BOUND * total_load * w.capacity / total_capacity)
            + LOAD_SLACK]


class Router:
    def __init__(self, policy: RoutingPolicy | str = RoutingPolicy.CACHE_AWARE):
        self.policy = RoutingPolicy(policy)
        # The box's KV tiers by the id their workers' HELLOs give: the prompt blocks sent to
        # any worker of one.
        self.tier_indexes: dict[str, PrefixIndex] = {}

    def tier_index(self, worker: WorkerHandle) -> PrefixIndex | None:
        """The index of the tier `worker` shares, None when it has none."""
        tier = worker.hello.kv_tier
        if not tier:
            return None
        num_blocks = min(worker.hello.kv_tier_num_blocks, MAX_TIER_INDEX_BLOCKS)
        index = self.tier_indexes.get(tier)
        if index is None:
            while len(self.tier_indexes) >= MAX_TIERS:
                del self.tier_indexes[next(iter(self.tier_indexes))]
            index = self.tier_indexes[tier] = PrefixIndex(num_blocks)
        index.capacity = max(index.capacity, num_blocks)
        return index

    def num_saved(self, worker: WorkerHandle, hashes: Sequence[int]) -> tuple[float, int]:
        """(The prompt blocks `worker` need not compute, a tier's counted at 1 -
        TIER_BLOCK_COST; those in its own pool)."""
        num_own = worker.prefix_index.num_matched(hashes)
        tier = self.tier_index(worker)
        num_tier = num_own if tier is None else max(num_own, tier.num_matched(hashes))
        return num_own + (1 - TIER_BLOCK_COST) * (num_tier - num_own), num_own

    def pick(self, candidates: Sequence[WorkerHandle],
             prefix: Prefix | None) -> WorkerHandle | None:
        if not candidates:
            return None
        if self.policy is RoutingPolicy.LEAST_LOADED or prefix is None or len(candidates) == 1:
            return least_loaded(candidates)
        allowed = within_bound(candidates)
        if not allowed:
            return least_loaded(candidates)
        best, best_score = None, None
        for worker in allowed:
            hashes = prefix.hashes(worker.hello.block_size)
            if not hashes:
                return least_loaded(candidates)  # shorter than a block: nothing to reuse
            num_saved, num_matched = self.num_saved(worker, hashes)
            # Ties (no worker holds it, or several hold the same part) go to the worker that
            # rendezvous hashing gives the first block past the shared part, or, when the
            # client names its conversation (prompt_cache_key), that name: each of the many
            # conversations behind one long system prompt then stays on its own worker.
            key = hashes[min(num_matched, len(hashes) - 1)] if prefix.cache_key is None \
                else prefix.cache_key
            score = (num_saved, rendezvous_weight(key, worker.worker_id))
            if best_score is None or score > best_score:
                best, best_score = worker, score
        return best

    def on_assigned(self, worker: WorkerHandle, prefix: Prefix | None) -> None:
        """The worker will compute (and cache) this prompt's blocks."""
        if prefix is not None and self.policy is RoutingPolicy.CACHE_AWARE:
            hashes = prefix.hashes(worker.hello.block_size)
            worker.prefix_index.add(hashes)
            tier = self.tier_index(worker)
            if tier is not None:  # its worker writes them through to the tier
                tier.add(hashes)
