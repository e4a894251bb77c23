"""Routing: which of the workers that can take a request gets it.

- `least_loaded`: the worker with the fewest requests in flight (ties: more free KV blocks).
- `cache_aware` (default): the worker that already holds the longest prefix of the prompt in
  its prefix cache, as long as that keeps its load within its bound (below);
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
from zeroserve.gateway.workers.prefix import Prefix

LOAD_BOUND = 1.25
LOAD_SLACK = 1


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
            num_matched = worker.prefix_index.num_matched(hashes)
            # Ties (no worker holds it, or several hold the same part) go to the worker that
            # rendezvous hashing gives the first block past the shared part, or, when the
            # client names its conversation (prompt_cache_key), that name: each of the many
            # conversations behind one long system prompt then stays on its own worker.
            key = hashes[min(num_matched, len(hashes) - 1)] if prefix.cache_key is None \
                else prefix.cache_key
            score = (num_matched, rendezvous_weight(key, worker.worker_id))
            if best_score is None or score > best_score:
                best, best_score = worker, score
        return best

    def on_assigned(self, worker: WorkerHandle, prefix: Prefix | None) -> None:
        """The worker will compute (and cache) this prompt's blocks."""
        if prefix is not None and self.policy is RoutingPolicy.CACHE_AWARE:
            worker.prefix_index.add(prefix.hashes(worker.hello.block_size))
