"""Paged KV cache bookkeeping: block ids, reference counts and the prefix cache. No torch.

The runner preallocates one pool per layer of `[num_blocks, block_size, kv_heads, head_dim]`;
this module only decides which block ids each sequence uses. A sequence's block table covers
exactly the tokens whose K/V are computed or being computed this step:
ceil(tokens / block_size) blocks, never a max-length reservation.

Prefix caching: once a block is full of computed K/V it is keyed by a chained hash of
(parent block hash, its tokens), rooted in a per-process random number, so equal prefixes
share physical blocks. A hit is verified against the whole lineage: the block's stored tokens
and the block its K/V were computed after (its parent, itself verified one step earlier), so
a hash collision, crafted or not, costs a miss, never another request's K/V. Blocks
with no users keep their contents and stay findable until a new allocation needs them; they
are evicted lazily in least-recently-freed order.

Free blocks that hold no cached prefix are reused last-freed-first (a stack). The pool is
preallocated but its pages become resident only when first written: handed out first-in-
first-out, blocks would walk the whole pool and a worker's memory would climb for as long
as it serves (a 4 GB pool touched page by page, though a few hundred blocks were ever in
use at once). Last-freed-first keeps the blocks written near the working set.

A box-wide KV tier (worker/kv_tier/, off unless set as `tier`) extends both ends: blocks
registered in the cache are reported to it for write-through (`on_full`), and an admission
whose prefix the cache does not hold looks the next blocks up there (`match_tier`) and loads
them into fresh blocks, which then count as computed and are registered like any other.
Every block taken for new contents is reported (`on_reuse`) before anything writes it: a
pool that lives in the tier publishes blocks where they lie, and their readers must know.

Invariants:
- every block is in exactly one place: held (ref_count > 0), free-uncached or evictable;
- a block another sequence may share is always full and is never written again (a sequence
  only writes positions >= its num_computed_tokens, which lie in its private tail blocks).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from zeroserve.worker.sequence import Sequence

HashFn = Callable[[int | None, tuple[int, ...]], int]


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Key of a full block: depends on every token before it through the parent hash."""
    return hash((parent_hash, token_ids))


class TierHook(Protocol):
    """The box's KV tier as the block manager sees it (worker/kv_tier/connector.py)."""

    def num_available(self, seq: Sequence, start: int, max_blocks: int) -> int:
        """How many of seq's full blocks start, start + 1, ... (< max_blocks) it holds."""
        ...

    def load(self, seq: Sequence, start: int, block_ids: list[int]) -> int:
        """Copy those blocks into pool blocks block_ids; how many (a prefix) were loaded."""
        ...

    def on_full(self, seq: Sequence, start: int, end: int, block_table: list[int]) -> None:
        """seq's blocks start .. end - 1 are newly full of computed K/V."""
        ...

    def forget(self, seq: Sequence) -> None:
        """seq will never be scheduled again."""
        ...

    def on_reuse(self, block_id: int) -> None:
        """Pool block block_id is taken for new contents: whatever it held is going."""
        ...


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "parent_id")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # set while the block is registered in the prefix cache
        # Kept to verify prefix-cache hits: its tokens, and the cached block before it in the
        # sequence it was computed for (None for a first block).
        self.token_ids: tuple[int, ...] | None = None
        self.parent_id: int | None = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = chain_hash,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Prompt tokens looked up in the prefix cache at first admission, and found there.
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self._hash_fn = hash_fn
        self.tier: TierHook | None = None  # the box's KV tier, when it is on
        self.num_tier_hit_tokens = 0  # tokens loaded from the tier at admission
        # The chain's root: random per process, so hashes cannot be precomputed elsewhere.
        self._root = secrets.randbits(63)
        self._blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks holding no cached prefix, a stack: the last freed is reused first (see
        # the module docstring); block 0 on top at the start.
        self._free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        # Unreferenced blocks still holding a cached prefix; oldest-freed first (LRU order).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, int] = {}  # chained hash -> block id
        # Per request: hashes of its full blocks so far (kept across preemption, since the
        # tokens only grow), and how many of its current blocks are registered in the cache.
        self._hash_chains: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}

    # ---- counts -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (including evictable cached ones)."""
        return len(self._free_uncached) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    # ---- admission with prefix-cache hits ------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of seq's tokens. No side effects.

        At most (num_tokens - 1) tokens are matched: the last token is always recomputed so
        the runner has logits to sample from. When the whole sequence is cached this drops
        the last cached block rather than writing into a block others may share.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        chain = self._hash_chain(seq, max_blocks)
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self._cached.get(chain[i])
            if block_id is None:
                break
            block = self._blocks[block_id]
            parent = hits[-1] if hits else None
            if block.token_ids != self._block_tokens(seq, i) or block.parent_id != parent:
                break  # hash collision: other tokens, or the same after another prefix
            hits.append(block_id)
        return hits

    def match_tier(self, seq: Sequence, num_hits: int) -> int:
        """How many blocks after seq's `num_hits` cached ones the tier holds (0 without one).
        Like match_prefix, the last token is always left to compute."""
        if self.tier is None or not self.enable_prefix_caching:
            return 0
        return self.tier.num_available(seq, num_hits, (seq.num_tokens - 1) // self.block_size)

    def can_admit(self, seq: Sequence, hits: list[int], num_new_tokens: int,
                  num_tier_blocks: int = 0) -> bool:
        """Whether seq (holding no blocks) can take `hits`, num_tier_blocks to load from the
        tier and room for num_new_tokens more."""
        num_held = len(hits) + num_tier_blocks
        num_needed = self.num_blocks_for(num_held * self.block_size + num_new_tokens) - len(hits)
        # Hit blocks nobody holds are counted as free now; taking them makes them unavailable.
        num_free_hits = sum(1 for b in hits if self._blocks[b].ref_count == 0)
        return num_needed <= self.num_free_blocks - num_free_hits

    def admit(self, seq: Sequence, hits: list[int], num_new_tokens: int,
              num_tier_blocks: int = 0) -> None:
        """Give seq the hit blocks, num_tier_blocks loaded from the tier (fewer if some went
        missing meanwhile: those stay as fresh blocks) and fresh ones for num_new_tokens
        (check can_admit first)."""
        assert not seq.block_table, "admit() is for sequences holding no blocks"
        for block_id in hits:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1
        seq.block_table = list(hits)
        self._num_registered[seq.request_id] = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        if num_tier_blocks and self.tier is not None:
            fresh = [self._take_free_block() for _ in range(num_tier_blocks)]
            seq.block_table += fresh
            num_loaded = self.tier.load(seq, len(hits), fresh)
            seq.num_computed_tokens += num_loaded * self.block_size
            self.num_tier_hit_tokens += num_loaded * self.block_size
            self._register(seq, write_through=False)  # findable in this pool from now on
        if seq.num_preemptions == 0:
            # Usage reports what the cache saved the request on arrival; a re-admission
            # after preemption finds its own blocks again, which saved the client nothing.
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            self.num_prefix_queries += seq.num_prompt_tokens
            self.num_prefix_hits += seq.num_cached_tokens
        self.allocate(seq, num_new_tokens)

    # ---- growth and release ----------------------------------------------------------------

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend seq's block table to cover num_computed_tokens + num_new_tokens."""
        num_needed = self.num_new_blocks(seq, num_new_tokens)
        if num_needed > self.num_free_blocks:
            raise RuntimeError("KV block pool exhausted (call can_allocate first)")
        for _ in range(num_needed):
            seq.block_table.append(self._take_free_block())

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink seq's block table to the blocks num_tokens tokens need (speculative drafts
        rejected). The blocks dropped were allocated for tokens never verified: private
        (never shared or registered: the cache only holds blocks of computed tokens), so
        they go straight back to the free pool."""
        keep = self.num_blocks_for(num_tokens)
        table = seq.block_table
        while len(table) > keep:
            block = self._blocks[table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free_uncached.append(block.block_id)
                else:
                    self._evictable[block.block_id] = None

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks (finish, abort or preemption); computed K/V stays findable."""
        # Tail blocks first, so a sequence's last blocks are evicted before its first ones.
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free_uncached.append(block_id)
                else:
                    self._evictable[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._num_registered.pop(seq.request_id, None)

    def forget(self, seq: Sequence) -> None:
        """Free seq's blocks and drop its hash chain: it will never be scheduled again."""
        self.free(seq)
        self._hash_chains.pop(seq.request_id, None)
        if self.tier is not None:
            self.tier.forget(seq)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's blocks that are now full of computed K/V in the prefix cache (and
        hand them to the tier, when there is one)."""
        self._register(seq, write_through=True)

    def _register(self, seq: Sequence, write_through: bool) -> None:
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = self._num_registered.get(seq.request_id, 0)
        if num_full <= start:
            return
        chain = self._hash_chain(seq, num_full)
        for i in range(start, num_full):
            block = self._blocks[seq.block_table[i]]
            if block.hash is None and chain[i] not in self._cached:
                block.hash = chain[i]
                block.token_ids = self._block_tokens(seq, i)
                # The copy a lookup of the previous block finds (this sequence's own, or an
                # equal one computed concurrently and cached first).
                block.parent_id = self._cached.get(chain[i - 1]) if i else None
                self._cached[chain[i]] = block.block_id
            # Otherwise it is a hit block (already registered) or an equal block computed
            # concurrently by another sequence; the first one stays the cached copy.
        self._num_registered[seq.request_id] = num_full
        if write_through and self.tier is not None:
            self.tier.on_full(seq, start, num_full, seq.block_table)

    # ---- internals --------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        if self._free_uncached:
            block_id = self._free_uncached.pop()  # the most recently freed
        else:
            block_id, _ = self._evictable.popitem(last=False)  # least recently freed
            block = self._blocks[block_id]
            if self._cached.get(block.hash) == block_id:
                del self._cached[block.hash]
            block.hash = None
            block.token_ids = None
            block.parent_id = None
        self._blocks[block_id].ref_count = 1
        if self.tier is not None:
            self.tier.on_reuse(block_id)  # before anything writes it (a pool in the tier)
        return block_id

    def block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        """The token ids of seq's block number `index` (which must be full)."""
        return self._block_tokens(seq, index)

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        end = start + self.block_size
        prompt = seq.prompt_token_ids
        num_prompt = len(prompt)
        if end <= num_prompt:
            return tuple(prompt[start:end])
        if start >= num_prompt:
            return tuple(seq.output_token_ids[start - num_prompt : end - num_prompt])
        return tuple(prompt[start:]) + tuple(seq.output_token_ids[: end - num_prompt])

    def _hash_chain(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Hashes of seq's first num_blocks full blocks, extending the cached chain as needed."""
        chain = self._hash_chains.setdefault(seq.request_id, [])
        while len(chain) < num_blocks:
            parent = chain[-1] if chain else self._root
            chain.append(self._hash_fn(parent, self._block_tokens(seq, len(chain))))
        return chain
