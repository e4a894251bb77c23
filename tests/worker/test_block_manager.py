from __future__ import annotations

import pytest

from tests.worker.factories import make_block_manager, make_seq, prompt
from zeroserve.worker.block_manager import BlockManager
from zeroserve.worker.sequence import Sequence


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """Pretend the runner computed num_tokens more of seq (allocating first)."""
    bm.allocate(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    bm.cache_full_blocks(seq)


def admit_and_compute(bm: BlockManager, seq: Sequence) -> int:
    """Admit seq with its prefix hits and compute the rest; returns the cached token count."""
    hits = bm.match_prefix(seq)
    num_new = seq.num_tokens - len(hits) * bm.block_size
    assert bm.can_admit(seq, hits, num_new)
    bm.admit(seq, hits, num_new)
    num_cached = seq.num_computed_tokens
    seq.num_computed_tokens += num_new
    bm.cache_full_blocks(seq)
    return num_cached


def test_a_sequence_uses_ceil_tokens_over_block_size_blocks():
    bm = make_block_manager(num_blocks=16, block_size=4)
    seq = make_seq(10)
    compute(bm, seq, 10)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 13
    # Growing within the last block takes nothing; crossing a boundary takes one block.
    compute(bm, seq, 2)
    assert len(seq.block_table) == 3
    compute(bm, seq, 1)
    assert len(seq.block_table) == 4
    assert len(set(seq.block_table)) == 4


def test_free_returns_every_block():
    bm = make_block_manager(num_blocks=10)
    seqs = [make_seq(9, prompt_token_ids=prompt(9, start=100 * i)) for i in range(3)]
    for seq in seqs:
        compute(bm, seq, 9)
    assert bm.num_free_blocks == 10 - 9
    for seq in seqs:
        bm.forget(seq)
    assert bm.num_free_blocks == 10
    assert all(bm.ref_count(b) == 0 for b in range(10))
    assert seqs[0].block_table == [] and seqs[0].num_computed_tokens == 0


def test_allocation_beyond_the_pool_is_refused_not_partial():
    bm = make_block_manager(num_blocks=2, block_size=4)
    seq = make_seq(12)
    assert not bm.can_allocate(seq, 12)
    with pytest.raises(RuntimeError):
        bm.allocate(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_shared_prefix_is_computed_once_and_reference_counted():
    bm = make_block_manager(num_blocks=16, block_size=4)
    first = make_seq(prompt_token_ids=prompt(12))
    assert admit_and_compute(bm, first) == 0
    second = make_seq(prompt_token_ids=prompt(8) + [7, 7, 7, 7, 7])
    # The two full blocks of the common prefix are hits: only the 5 new tokens are computed.
    assert admit_and_compute(bm, second) == 8
    assert second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert [bm.ref_count(b) for b in first.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == 16 - 3 - 2
    bm.forget(first)
    assert [bm.ref_count(b) for b in second.block_table[:2]] == [1, 1]


def test_whole_prompt_cached_still_recomputes_the_last_block():
    bm = make_block_manager(num_blocks=16, block_size=4)
    first = make_seq(prompt_token_ids=prompt(12))
    admit_and_compute(bm, first)
    again = make_seq(prompt_token_ids=prompt(12))
    # All 3 blocks are cached, but the last token needs logits: its block is not shared.
    assert admit_and_compute(bm, again) == 8
    assert again.block_table[:2] == first.block_table[:2]
    assert again.block_table[2] != first.block_table[2]


def test_a_hash_collision_is_caught_by_comparing_tokens():
    bm = make_block_manager(num_blocks=16, block_size=4, hash_fn=lambda parent, tokens: 42)
    first = make_seq(prompt_token_ids=prompt(8))
    admit_and_compute(bm, first)
    other = make_seq(prompt_token_ids=prompt(8, start=500) + [1])
    assert bm.match_prefix(other) == []
    same = make_seq(prompt_token_ids=prompt(4) + [1])
    assert bm.match_prefix(same) == first.block_table[:1]


def test_freed_blocks_stay_cached_until_evicted_least_recently_freed_first():
    bm = make_block_manager(num_blocks=4, block_size=4)
    old = make_seq(prompt_token_ids=prompt(5, start=100))
    new = make_seq(prompt_token_ids=prompt(5, start=200))
    admit_and_compute(bm, old)
    admit_and_compute(bm, new)
    bm.forget(old)
    bm.forget(new)
    # Each left one full cached block; all 4 blocks are free for allocation.
    assert bm.num_free_blocks == 4
    assert bm.num_cached_blocks == 2
    # Needing 3 blocks uses the 2 never-cached ones, then evicts the oldest cached block.
    taker = make_seq(prompt_token_ids=prompt(12, start=900))
    compute(bm, taker, 12)
    assert bm.num_cached_blocks == 1
    assert bm.match_prefix(make_seq(prompt_token_ids=prompt(5, start=100))) == []
    assert len(bm.match_prefix(make_seq(prompt_token_ids=prompt(5, start=200)))) == 1


def test_a_hit_on_a_freed_cached_block_takes_it_off_the_free_list():
    bm = make_block_manager(num_blocks=4, block_size=4)
    first = make_seq(prompt_token_ids=prompt(9))
    admit_and_compute(bm, first)
    bm.forget(first)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    again = make_seq(prompt_token_ids=prompt(9))
    assert admit_and_compute(bm, again) == 8
    assert bm.num_cached_blocks == 0
    assert bm.num_free_blocks == 1


def test_can_admit_counts_unreferenced_hits_as_taken():
    bm = make_block_manager(num_blocks=3, block_size=4)
    first = make_seq(prompt_token_ids=prompt(9))
    admit_and_compute(bm, first)
    bm.forget(first)
    again = make_seq(prompt_token_ids=prompt(8) + [5] * 8)  # 2 hits + 8 new tokens
    hits = bm.match_prefix(again)
    assert len(hits) == 2
    # 2 hit blocks + 2 new blocks > 3 in the pool, even though 3 blocks are "free".
    assert not bm.can_admit(again, hits, 8)
    assert bm.can_admit(again, hits, 4)


def test_output_token_blocks_become_cacheable_once_full():
    bm = make_block_manager(num_blocks=16, block_size=4)
    seq = make_seq(prompt_token_ids=prompt(6))
    admit_and_compute(bm, seq)
    seq.output_token_ids += [1, 2, 3]
    compute(bm, seq, 3)  # 9 computed tokens: blocks 0 and 1 (prompt + 2 outputs) are full
    follow_up = make_seq(prompt_token_ids=prompt(6) + [1, 2, 3, 4])
    assert bm.match_prefix(follow_up) == seq.block_table[:2]


def test_prefix_caching_off_never_hits():
    bm = make_block_manager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    first = make_seq(prompt_token_ids=prompt(12))
    admit_and_compute(bm, first)
    bm.forget(first)
    assert bm.num_cached_blocks == 0
    assert bm.match_prefix(make_seq(prompt_token_ids=prompt(12))) == []


def test_preempted_sequence_finds_its_own_blocks_again():
    bm = make_block_manager(num_blocks=16, block_size=4)
    seq = make_seq(prompt_token_ids=prompt(10))
    admit_and_compute(bm, seq)
    seq.output_token_ids += [3]
    bm.free(seq)  # preemption: blocks released, hash chain kept
    assert seq.num_computed_tokens == 0 and seq.block_table == []
    assert admit_and_compute(bm, seq) == 8


def test_a_freed_sequence_loses_its_tail_blocks_before_its_head():
    bm = make_block_manager(num_blocks=3, block_size=4)
    seq = make_seq(prompt_token_ids=prompt(9))
    admit_and_compute(bm, seq)
    bm.forget(seq)
    compute(bm, make_seq(prompt_token_ids=prompt(8, start=600)), 8)  # evicts one cached block
    # The first block, the one every longer prompt needs, is still there.
    assert len(bm.match_prefix(make_seq(prompt_token_ids=prompt(9)))) == 1


def test_a_colliding_block_after_another_prefix_is_a_miss():
    # A hash that ignores the parent makes every block with the same tokens collide, as a
    # crafted collision would: lineage must catch what the token check alone cannot.
    bm = make_block_manager(num_blocks=16, block_size=4,
                            hash_fn=lambda parent, tokens: hash(tokens))
    a = make_seq(prompt_token_ids=prompt(4, start=100) + prompt(4, start=900) + [1])
    admit_and_compute(bm, a)  # caches [100..103] and [900..903] computed after it
    b = make_seq(prompt_token_ids=prompt(4, start=300) + prompt(4, start=900) + [1])
    admit_and_compute(bm, b)  # caches [300..303]; its [900..903] collides with a's
    probe = make_seq(prompt_token_ids=prompt(4, start=300) + prompt(4, start=900) + [1])
    # Block 0 is b's; block 1 would be a's [900..903], whose K/V followed [100..103].
    assert bm.match_prefix(probe) == b.block_table[:1]
    same_as_a = make_seq(prompt_token_ids=prompt(4, start=100) + prompt(4, start=900) + [1])
    assert bm.match_prefix(same_as_a) == a.block_table[:2]


def _handed_out_over_cycles(bm: BlockManager, prompts: list[list[int]],
                            num_cycles: int) -> set[int]:
    """Run the same small working set (one sequence per prompt, at once) num_cycles times,
    freeing everything between cycles; the block ids ever handed out."""
    ever: set[int] = set()
    for _ in range(num_cycles):
        seqs = [make_seq(len(p), prompt_token_ids=list(p)) for p in prompts]
        for seq in seqs:
            admit_and_compute(bm, seq)
            ever.update(seq.block_table)
        for seq in seqs:
            bm.forget(seq)
    return ever


def test_a_small_working_set_keeps_to_a_few_blocks_of_a_large_pool():
    # The pool's pages become resident once written: blocks handed out first-in-first-out
    # walk the whole pool, and a worker's memory climbs for as long as it serves.
    bm = make_block_manager(num_blocks=1000, block_size=4, enable_prefix_caching=False)
    prompts = [prompt(10, start=100 * i) for i in range(4)]  # 3 blocks each
    ever = _handed_out_over_cycles(bm, prompts, num_cycles=200)
    assert len(ever) <= 12
    assert bm.num_free_blocks == 1000


def test_with_prefix_caching_reused_prefixes_and_fresh_tails_stay_in_few_blocks():
    # A shared prefix stays cached (and is hit every cycle); the tails never fill a block,
    # so they are never cached and go back to the free stack, to be reused next.
    bm = make_block_manager(num_blocks=1000, block_size=4)
    shared = prompt(8, start=7)
    prompts = [shared + [500 + i, 600 + i] for i in range(4)]
    ever = _handed_out_over_cycles(bm, prompts, num_cycles=200)
    assert len(ever) <= 2 + 4
    assert bm.num_cached_blocks == 2
