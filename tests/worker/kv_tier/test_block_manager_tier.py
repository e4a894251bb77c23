"""The block manager and scheduler with a KV tier (a fake one: no torch): what admission loads,
what counts as computed, and what is handed over for write-through."""

from __future__ import annotations

from tests.worker.factories import make_scheduler, make_seq
from zeroserve.worker.block_manager import BlockManager
from zeroserve.worker.plan import SampledToken
from zeroserve.worker.sequence import Sequence


class FakeTier:
    """Holds blocks by (request-independent) token prefix; `vanish` blocks disappear between
    the lookup and the load (evicted by another worker meanwhile)."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.held: set[tuple[int, ...]] = set()  # prefixes ending at a block boundary
        self.vanish: set[int] = set()  # block indices that go missing at load
        self.loaded: list[tuple[int, int]] = []  # (block index, pool block id)
        self.written: list[tuple[int, ...]] = []
        self.forgotten: list[str] = []
        self.reused: list[int] = []  # pool blocks taken for new contents, in order

    def _prefix(self, seq: Sequence, index: int) -> tuple[int, ...]:
        return tuple(t for i in range(index + 1) for t in self.bm.block_tokens(seq, i))

    def num_available(self, seq: Sequence, start: int, max_blocks: int) -> int:
        num = 0
        for index in range(start, max_blocks):
            if self._prefix(seq, index) not in self.held:
                break
            num += 1
        return num

    def load(self, seq: Sequence, start: int, block_ids: list[int]) -> int:
        for offset, block_id in enumerate(block_ids):
            if start + offset in self.vanish:
                return offset
            self.loaded.append((start + offset, block_id))
        return len(block_ids)

    def on_full(self, seq: Sequence, start: int, end: int, block_table: list[int]) -> None:
        for index in range(start, end):
            self.written.append(self._prefix(seq, index))
            self.held.add(self._prefix(seq, index))

    def forget(self, seq: Sequence) -> None:
        self.forgotten.append(seq.request_id)

    def on_reuse(self, block_id: int) -> None:
        self.reused.append(block_id)


def tiered(num_blocks: int = 32, budget: int = 64):
    scheduler, _ = make_scheduler(num_kv_blocks=num_blocks, block_size=4,
                                  max_num_batched_tokens=budget)
    tier = FakeTier(scheduler.block_manager)
    scheduler.block_manager.tier = tier
    return scheduler, tier


def test_admission_loads_the_blocks_the_tier_holds_and_computes_only_the_tail():
    scheduler, tier = tiered()
    seq = make_seq(request_id="a", prompt_token_ids=list(range(1, 15)))  # 14 tokens: 3 full blocks and 2 more
    tier.held = {tuple(range(1, 5)), tuple(range(1, 9)), tuple(range(1, 13))}
    scheduler.add(seq)
    plan = scheduler.schedule()
    assert [b for _, b in tier.loaded] == seq.block_table[:3]
    assert plan.chunks[0].start_pos == 12  # only the last two tokens run
    assert plan.chunks[0].token_ids == [13, 14]
    assert seq.num_cached_tokens == 12
    assert scheduler.block_manager.num_tier_hit_tokens == 12


def test_the_last_token_is_always_computed_even_when_the_tier_holds_it():
    scheduler, tier = tiered()
    seq = make_seq(request_id="a", prompt_token_ids=list(range(1, 9)))  # exactly two blocks
    tier.held = {tuple(range(1, 5)), tuple(range(1, 9))}
    scheduler.add(seq)
    plan = scheduler.schedule()
    assert len(tier.loaded) == 1
    assert plan.chunks[0].start_pos == 4 and plan.chunks[0].do_sample


def test_a_block_gone_between_lookup_and_load_is_computed_instead():
    scheduler, tier = tiered()
    seq = make_seq(request_id="a", prompt_token_ids=list(range(1, 15)))
    tier.held = {tuple(range(1, 5)), tuple(range(1, 9)), tuple(range(1, 13))}
    tier.vanish = {1}
    scheduler.add(seq)
    plan = scheduler.schedule()
    assert len(tier.loaded) == 1
    # It computes from the missing block on (this step's chunk as planned, the rest next).
    assert plan.chunks[0].start_pos == 4
    assert plan.chunks[0].token_ids == [5, 6]
    assert len(seq.block_table) == 3  # the fresh blocks stay, for the tokens computed
    scheduler.update(plan, [])
    plan = scheduler.schedule()
    assert plan.chunks[0].start_pos == 6
    assert plan.chunks[0].token_ids == list(range(7, 15))


def test_loaded_blocks_join_the_pool_cache_and_are_not_written_back():
    scheduler, tier = tiered()
    tier.held = {tuple(range(1, 5)), tuple(range(1, 9))}
    first = make_seq(request_id="a", prompt_token_ids=list(range(1, 11)))
    scheduler.add(first)
    scheduler.update(scheduler.schedule(), [SampledToken("a", 99)])  # the tail's 2 tokens
    assert tier.written == []  # the two loaded blocks are in the tier already
    second = make_seq(request_id="b", prompt_token_ids=list(range(1, 11)))
    assert len(scheduler.block_manager.match_prefix(second)) == 2  # cached in the pool now


def test_full_blocks_are_handed_to_the_tier_and_the_chain_is_dropped_at_the_end():
    scheduler, tier = tiered()
    seq = make_seq(request_id="a", prompt_token_ids=list(range(1, 11)), max_tokens=1)
    scheduler.add(seq)
    plan = scheduler.schedule()
    scheduler.update(plan, [SampledToken("a", 99)])
    assert tier.written == [tuple(range(1, 5)), tuple(range(1, 9))]
    assert tier.forgotten == ["a"]  # finished


def test_admission_counts_the_tier_blocks_against_the_pool():
    scheduler, tier = tiered(num_blocks=3)
    tier.held = {tuple(range(1, 5)), tuple(range(1, 9))}
    bm = scheduler.block_manager
    seq = make_seq(request_id="a", prompt_token_ids=list(range(1, 11)))
    assert bm.can_admit(seq, [], 2, num_tier_blocks=2)  # 3 blocks: all the pool
    bm.allocate(make_seq(request_id="x", prompt_token_ids=[1]), 1)  # one block taken
    assert not bm.can_admit(seq, [], 2, num_tier_blocks=2)


def test_every_block_taken_for_new_contents_is_reported_first():
    """A pool in the tier publishes blocks where they lie: when a cached block is evicted and
    taken for another sequence, the tier must hear of it before the step writes it (its
    published copy is stale from then on)."""
    scheduler, tier = tiered(num_blocks=3)
    bm = scheduler.block_manager
    first = make_seq(request_id="a", prompt_token_ids=list(range(1, 9)))  # two full blocks
    bm.allocate(first, 8)
    first.num_computed_tokens = 8
    bm.cache_full_blocks(first)
    assert tier.written == [tuple(range(1, 5)), tuple(range(1, 9))]
    cached = list(first.block_table)
    assert tier.reused == cached  # taken (fresh) for the first sequence
    bm.forget(first)  # its blocks stay cached, evictable
    second = make_seq(request_id="b", prompt_token_ids=list(range(20, 32)))  # three blocks
    bm.allocate(second, 12)
    assert sorted(tier.reused[2:]) == sorted(second.block_table)
    assert set(cached) <= set(tier.reused[2:])  # the cached blocks it evicted, reported
