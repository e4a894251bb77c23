"""A CPU worker's KV pool living in the tier's folder (worker/kv_tier/pool_file.py): blocks
are published without a copy and read by other processes bit for bit; a block its owner
reused since is a miss, never another block's K/V; a SIGKILLed owner's pool keeps serving
reads until the bound evicts it; live pools count in the bound and are never evicted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.cli.test_cli import captured, invoke  # noqa: F401 - captured is a fixture
from zeroserve.cli.child_args import engine_args
from zeroserve.cli.harness import REPO_ROOT, child_env
from zeroserve.worker.block_manager import BlockManager
from zeroserve.worker.kv_tier import pool_file
from zeroserve.worker.kv_tier.connector import KVTierConnector
from zeroserve.worker.kv_tier.digest import block_digest
from zeroserve.worker.kv_tier.store import HEADER, TierLevel, TierStore
from zeroserve.worker.sequence import SamplingParams, Sequence

LAYERS, BLOCKS, BS, HEADS, DIM = 2, 8, 4, 2, 8
KEY = bytes(range(16))
TOKENS = list(range(1, 10))  # two full blocks of 4, and one token more
BOUND = 1 << 20


def pool_in_tier(folder: Path, dtype=torch.bfloat16, bound: int = BOUND):
    """What allocate_pool makes for a runner: a pool tensor over a file in the tier."""
    level = TierLevel(folder, bound, KEY)
    slab_bytes = BS * HEADS * DIM * torch.empty((), dtype=dtype).element_size()
    made = level.create_pool(BLOCKS, LAYERS * 2, slab_bytes)
    assert made is not None
    numel = LAYERS * 2 * BLOCKS * BS * HEADS * DIM
    pool = torch.frombuffer(made.mapped, dtype=dtype, count=numel,
                            offset=made.data_offset).view(LAYERS, 2, BLOCKS, BS, HEADS, DIM)
    return pool, made


def owner(folder: Path, dtype=torch.bfloat16) -> tuple[KVTierConnector, BlockManager]:
    pool, made = pool_in_tier(folder, dtype)
    pool.copy_(torch.randn(pool.shape).to(dtype))
    bm = BlockManager(BLOCKS, BS)
    tier = KVTierConnector(TierStore([TierLevel(folder, BOUND, KEY)]), pool, KEY,
                           bm.block_tokens, pool_file=made)
    bm.tier = tier
    return tier, bm


def publish(tier: KVTierConnector, request_id: str = "a") -> Sequence:
    """A sequence whose two full blocks sit in pool blocks 5 and 3, published."""
    seq = Sequence(request_id, TOKENS, SamplingParams(max_tokens=4))
    tier.on_full(seq, 0, 2, [5, 3])
    assert tier.wait_written(timeout_s=30)
    return seq


def digests() -> list[bytes]:
    first = block_digest(KEY, tuple(TOKENS[:4]))
    return [first, block_digest(first, tuple(TOKENS[4:8]))]


# Another process (a worker of the box, or the owner's restarted process) reads the two
# blocks with a store of its own and prints them.
READER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from zeroserve.worker.kv_tier.digest import block_digest
    from zeroserve.worker.kv_tier.store import TierLevel, TierStore
    key, tokens = bytes(range(16)), list(range(1, 10))
    store = TierStore([TierLevel(Path(sys.argv[1]), 1 << 20, key)])
    first = block_digest(key, tuple(tokens[:4]))
    second = block_digest(first, tuple(tokens[4:8]))
    for digest, block in ((first, tokens[:4]), (second, tokens[4:8])):
        payload = store.get(digest, block)
        print("miss" if payload is None else bytes(payload).hex())
""")


def read_in_another_process(folder: Path) -> list[str]:
    done = subprocess.run([sys.executable, "-c", READER, str(folder)], cwd=REPO_ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def block_hex(pool: torch.Tensor, block: int) -> str:
    return pool[:, :, block].contiguous().view(torch.uint8).numpy().tobytes().hex()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_block_published_from_the_pool_reads_back_in_another_process(tmp_path, dtype):
    folder = tmp_path / "tier"
    tier, _ = owner(folder, dtype)
    publish(tier)
    assert tier.counters.num_puts == 2
    # Published without the payload: an entry is a header, the tokens and a reference.
    for digest in digests():
        assert tier.store.levels[0].path(digest).stat().st_size < tier.block_bytes
    assert read_in_another_process(folder) == [block_hex(tier.pool, 5),
                                               block_hex(tier.pool, 3)]
    # And loads into a pool block of this process bit for bit, as from a copied block.
    reader = Sequence("b", TOKENS, SamplingParams(max_tokens=4))
    assert tier.load(reader, 0, [0, 7]) == 2
    assert torch.equal(tier.pool[:, :, 0], tier.pool[:, :, 5])
    assert torch.equal(tier.pool[:, :, 7], tier.pool[:, :, 3])
    tier.close()


def test_a_block_the_owner_reused_after_publishing_is_a_miss_never_a_wrong_block(tmp_path):
    folder = tmp_path / "tier"
    tier, bm = owner(folder)
    publish(tier)
    tier.on_reuse(5)  # the block manager took block 5 for another sequence ...
    tier.pool[:, :, 5] = 7.0  # ... and the step wrote it
    assert read_in_another_process(folder) == ["miss", block_hex(tier.pool, 3)]
    assert not tier.store.levels[0].path(digests()[0]).exists()  # a stale entry is removed
    # Written over without a generation (a torn write, a bug): the crc32 still catches it.
    tier.pool[:, :, 3, 0] += 1.0
    assert read_in_another_process(folder) == ["miss", "miss"]
    tier.close()


def test_a_block_reused_while_the_writer_read_it_is_not_published(tmp_path, monkeypatch):
    folder = tmp_path / "tier"
    tier, _ = owner(folder)
    made = tier.pool_file
    real_crc = made.crc

    def crc_while_reused(block: int) -> int:
        value = real_crc(block)
        made.bump(block)  # taken by the next step while the thread read it
        return value

    monkeypatch.setattr(made, "crc", crc_while_reused)
    publish(tier)
    assert tier.counters.num_puts == 0 and tier.counters.num_dropped == 2
    assert not any(tier.store.contains(d) for d in digests())
    tier.close()


def test_blocks_taken_by_the_block_manager_go_stale(tmp_path):
    """The block manager's on_reuse reaches the pool: a cached block evicted for another
    sequence is no longer served from the tier."""
    folder = tmp_path / "tier"
    tier, bm = owner(folder)
    seq = Sequence("a", TOKENS[:8], SamplingParams(max_tokens=4))
    bm.allocate(seq, 8)
    seq.num_computed_tokens = 8
    bm.cache_full_blocks(seq)
    assert tier.wait_written(timeout_s=30)
    held = list(seq.block_table)
    assert read_in_another_process(folder) == [block_hex(tier.pool, b) for b in held]
    bm.forget(seq)
    other = Sequence("b", list(range(50, 50 + 4 * BLOCKS)), SamplingParams(max_tokens=4))
    bm.allocate(other, 4 * BLOCKS)  # every block, the cached ones too
    assert read_in_another_process(folder) == ["miss", "miss"]
    tier.close()


# An owner that publishes its two blocks (seeded contents), says so, and waits to be killed.
OWNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    sys.path.insert(0, ".")
    from tests.worker.kv_tier.test_pool_in_tier import owner, publish
    torch.manual_seed(5)
    tier, _ = owner(Path(sys.argv[1]))
    publish(tier)
    print(tier.pool[:, :, 5].contiguous().view(torch.uint8).numpy().tobytes().hex(),
          tier.pool[:, :, 3].contiguous().view(torch.uint8).numpy().tobytes().hex(),
          flush=True)
    while True:
        time.sleep(1)
""")


def test_a_sigkilled_owners_pool_serves_reads_until_evicted(tmp_path):
    folder = tmp_path / "tier"
    child = subprocess.Popen([sys.executable, "-c", OWNER, str(folder)], cwd=REPO_ROOT,
                             env=child_env(), stdout=subprocess.PIPE, text=True)
    try:
        expected = child.stdout.readline().split()
        assert len(expected) == 2
        [pool_path] = folder.glob("*" + pool_file.POOL_SUFFIX)
        assert pool_file.is_live(pool_path)
        assert read_in_another_process(folder) == expected
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    assert not pool_file.is_live(pool_path)
    assert read_in_another_process(folder) == expected  # the dead worker's blocks
    TierLevel(folder, BOUND, KEY)._evict(0)  # now the bound may take it
    assert not pool_path.exists()
    assert read_in_another_process(folder) == ["miss", "miss"]


def test_the_bound_holds_with_pool_files_counted(tmp_path):
    folder = tmp_path / "tier"
    bound = 256 << 10
    _, live = pool_in_tier(folder, torch.float32, bound)
    dead_level = TierLevel(folder, bound, KEY)
    dead_size = pool_file.file_bytes(BLOCKS, LAYERS * 2, 16)
    payload = bytes(range(256)) * 16  # 4 KiB
    tier = TierLevel(folder, bound, KEY)
    assert tier.usage_bytes() == live.size  # the live pool counts from its creation
    # A dead worker's pool (made and unlocked: as if its process ended).
    dead = dead_level.create_pool(BLOCKS, LAYERS * 2, 16)
    assert dead is not None and dead.size == dead_size
    dead.close()  # its lock goes, as with its process
    for n in range(200):  # ~800 KiB of distinct blocks through a 256 KiB tier
        tokens = tuple(range(n, n + 4))
        assert tier.put(block_digest(KEY, tokens), tokens, payload)
        on_disk = sum(p.stat().st_size for p in folder.iterdir()
                      if p.name.endswith((".kv", pool_file.POOL_SUFFIX)))
        assert on_disk <= bound
        assert tier.usage_bytes() <= bound
    assert live.path.exists()  # never evicted while its owner lives
    assert not dead.path.exists()  # the dead one's room went to blocks
    assert tier.counters.num_evictions > 0


def test_a_pool_is_not_put_in_the_tier_past_half_of_the_bound(tmp_path):
    level = TierLevel(tmp_path / "tier", 64 << 10, KEY)
    assert level.create_pool(BLOCKS, LAYERS * 2, 2048) is None  # 72 KiB: more than the tier
    first = level.create_pool(BLOCKS, LAYERS * 2, 256)  # 16 KiB
    second = level.create_pool(BLOCKS, LAYERS * 2, 256)  # 32 KiB live: half, still in
    assert first is not None and second is not None
    assert level.create_pool(BLOCKS, LAYERS * 2, 256) is None  # past half: copies instead
    assert level.usage_bytes() == first.size + second.size
    first.close()  # its process ended: a dead pool does not count against new ones
    assert level.create_pool(BLOCKS, LAYERS * 2, 256) is not None


def test_files_are_private(tmp_path):
    folder = tmp_path / "tier"
    tier, _ = owner(folder)
    publish(tier)
    for path in folder.iterdir():
        if path.name.endswith((".kv", pool_file.POOL_SUFFIX)):
            assert path.stat().st_mode & 0o777 == 0o600, path
    assert folder.stat().st_mode & 0o777 == 0o700
    tier.close()


def test_the_entry_header_is_the_blocks_header(tmp_path):
    """An entry carries the same header as a block file (model, digest, tokens, crc32)."""
    folder = tmp_path / "tier"
    tier, _ = owner(folder)
    publish(tier)
    data = tier.store.levels[0].path(digests()[0]).read_bytes()
    _, _, model, digest, num_tokens, payload_len, _ = HEADER.unpack_from(data, 0)
    assert (model, digest, num_tokens, payload_len) == (KEY, digests()[0], 4, tier.block_bytes)
    tier.close()


def test_the_flag_turns_the_pool_in_the_tier_off_and_reaches_serve_children(captured):  # noqa: F811
    result = invoke(["worker", "--kv-offloading-size", "0.5", "--no-kv-pool-in-tier"])
    assert result.exit_code == 0, result.output
    engine = captured["worker"].engine
    assert engine.kv_pool_in_tier is False
    assert invoke(["worker", *engine_args(engine)]).exit_code == 0
    assert captured["worker"].engine == engine
    assert invoke(["worker", "--kv-offloading-size", "0.5"]).exit_code == 0
    assert captured["worker"].engine.kv_pool_in_tier is True  # on by default


def test_tokens_computed_again_after_their_block_was_reused_are_published_again(tmp_path):
    """The connector skips digests it published; once the pool block holding one is reused,
    the entry is stale, and the same tokens computed into another block must replace it."""
    folder = tmp_path / "tier"
    tier, _ = owner(folder)
    seq = publish(tier)  # blocks 5 and 3
    tier.on_reuse(5)
    tier.pool[:, :, 5] = 7.0
    tier.pool[:, :, 2] = torch.randn(tier.pool[:, :, 2].shape).to(tier.pool.dtype)
    tier.on_full(seq, 0, 2, [2, 3])  # the first block computed again, into block 2
    assert tier.wait_written(timeout_s=30)
    assert read_in_another_process(folder) == [block_hex(tier.pool, 2),
                                               block_hex(tier.pool, 3)]
    tier.close()


def test_a_pool_that_published_lately_is_evicted_after_older_blocks(tmp_path):
    """A restarted worker needs its dead process's pool most: the pool's age is its last
    publish, not its creation, so older blocks go first."""
    folder = tmp_path / "tier"
    tier, _ = owner(folder)
    made = tier.pool_file
    os.utime(made.path, (1, 1))  # created long ago
    old = TierLevel(folder, BOUND, KEY)
    tokens = tuple(range(500, 504))
    old.put(block_digest(KEY, tokens), tokens, b"x" * 1000)
    os.utime(old.path(block_digest(KEY, tokens)), (2, 2))
    publish(tier)
    tier.close()
    made.close()  # its process ended
    old._evict(old.usage_bytes() - 1000)  # room for one more: the oldest goes
    assert made.path.exists()
    assert not old.path(block_digest(KEY, tokens)).exists()
