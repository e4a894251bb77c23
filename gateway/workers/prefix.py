"""What a worker's prefix cache likely holds, as the gateway sees it: a prompt's chained
full-block hashes (`Prefix`, computed once per block size) and one worker's LRU index of the
block hashes routed to it (`PrefixIndex`). gateway/workers/routing.py explains the use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# Prompt blocks hashed for routing: a longer shared prefix than this many blocks adds little.
MAX_ROUTED_BLOCKS = 2048


class Prefix:
    """A prompt's chained full-block hashes, per block size, computed once when first asked."""

    __slots__ = ("token_ids", "cache_key", "_hashes")

    def __init__(self, token_ids: Sequence[int], cache_key: str | None = None):
        self.token_ids = token_ids
        self.cache_key = cache_key  # the client's conversation name (prompt_cache_key)
        self._hashes: dict[int, list[int]] = {}

    def hashes(self, block_size: int) -> list[int]:
        hashes = self._hashes.get(block_size)
        if hashes is None:
            hashes = self._hashes[block_size] = block_hashes(self.token_ids, block_size)
        return hashes


def block_hashes(token_ids: Sequence[int], block_size: int,
                 max_blocks: int = MAX_ROUTED_BLOCKS) -> list[int]:
    """One hash per full block, each covering all the blocks before it (so equal hashes at
    position i mean equal prompts up to the end of block i, hash collisions aside)."""
    num_blocks = min(len(token_ids) // block_size, max_blocks)
    out = []
    h = 0
    for i in range(num_blocks):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return out


class PrefixIndex:
    """The block hashes one worker was sent, least recently used first, at most `capacity`."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def num_matched(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt with these hashes this worker likely holds."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[int]) -> None:
        blocks = self._blocks
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
