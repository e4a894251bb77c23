"""The connector between a KV pool and the tier: blocks written through after a step come back
bit for bit into other pool blocks, in any dtype; a writer that is behind drops, never blocks."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from zeroserve.cli.harness import REPO_ROOT, child_env
from zeroserve.worker.block_manager import BlockManager
from zeroserve.worker.kv_tier.connector import KVTierConnector
from zeroserve.worker.kv_tier.store import TierLevel, TierStore
from zeroserve.worker.sequence import SamplingParams, Sequence

LAYERS, BLOCKS, BS, HEADS, DIM = 2, 8, 4, 2, 8
KEY = bytes(16)


def connector(tmp_path, dtype=torch.bfloat16, **kwargs) -> tuple[KVTierConnector, BlockManager]:
    pool = torch.randn(LAYERS, 2, BLOCKS, BS, HEADS, DIM).to(dtype)
    bm = BlockManager(BLOCKS, BS)
    store = TierStore([TierLevel(tmp_path / "tier", 1 << 20, KEY)])
    tier = KVTierConnector(store, pool, KEY, bm.block_tokens, **kwargs)
    bm.tier = tier
    return tier, bm


def seq(request_id: str = "a") -> Sequence:
    return Sequence(request_id, list(range(1, 10)), SamplingParams(max_tokens=4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_blocks_written_through_load_back_bit_for_bit(tmp_path, dtype):
    tier, _ = connector(tmp_path, dtype)
    written = seq()
    tier.on_full(written, 0, 2, [5, 3])
    tier.flush()
    tier.close()
    assert tier.counters.num_puts == 2
    reader = seq("b")  # the same tokens, another request (another worker)
    assert tier.num_available(reader, 0, 2) == 2
    assert tier.load(reader, 0, [0, 7]) == 2
    assert torch.equal(tier.pool[:, :, 0], tier.pool[:, :, 5])
    assert torch.equal(tier.pool[:, :, 7], tier.pool[:, :, 3])


def test_a_writer_behind_drops_blocks_instead_of_blocking_the_step(tmp_path):
    tier, _ = connector(tmp_path, max_queued_bytes=1)  # less than one block
    tier.on_full(seq(), 0, 2, [5, 3])
    tier.flush()  # returns at once
    tier.close()
    assert tier.counters.num_dropped == 2
    assert tier.counters.num_puts == 0
    assert tier.num_available(seq("b"), 0, 2) == 0  # a miss: computed, never wrong


def test_other_tokens_find_nothing(tmp_path):
    tier, _ = connector(tmp_path)
    tier.on_full(seq(), 0, 2, [5, 3])
    tier.close()
    other = Sequence("c", [1, 2, 3, 4, 9, 9, 9, 9, 9], SamplingParams(max_tokens=4))
    assert tier.num_available(other, 0, 2) == 1  # the first block is the same; the second not


def test_wait_written_returns_once_every_queued_block_is_published(tmp_path):
    tier, _ = connector(tmp_path)
    tier.on_full(seq(), 0, 2, [5, 3])
    assert tier.wait_written(timeout_s=30)
    assert tier.counters.num_puts == 2  # written, and the writer still runs
    tier.on_full(seq("b"), 0, 1, [1])
    assert tier.wait_written(timeout_s=30)
    tier.close()


def test_a_request_looked_up_again_while_it_waits_counts_one_miss(tmp_path):
    tier, _ = connector(tmp_path)
    waiting = seq()
    for _ in range(5):  # the scheduler asks each step until the pool has room
        assert tier.num_available(waiting, 0, 2) == 0
    assert tier.counters.num_misses == 1
    tier.forget(waiting)
    tier.close()


# A process whose writer is slow (a busy disk: each put takes 0.2 s) queues two blocks and
# exits at once, as a worker does at the end of a drain or a restart.
EXITING_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from zeroserve.worker.block_manager import BlockManager
    from zeroserve.worker.kv_tier.connector import KVTierConnector
    from zeroserve.worker.kv_tier.store import TierLevel, TierStore
    from zeroserve.worker.sequence import SamplingParams, Sequence

    class SlowStore(TierStore):
        def put(self, *args):
            time.sleep(0.2)
            return super().put(*args)

    key = bytes(16)
    bm = BlockManager(8, 4)
    store = SlowStore([TierLevel(Path(sys.argv[1]), 1 << 20, key)])
    tier = KVTierConnector(store, torch.randn(2, 2, 8, 4, 2, 8), key, bm.block_tokens)
    tier.on_full(Sequence("a", list(range(1, 10)), SamplingParams(max_tokens=4)), 0, 2, [5, 3])
    tier.flush()
    sys.exit(0)
""")


@pytest.mark.slow
def test_an_orderly_exit_writes_the_queued_blocks_first(tmp_path):
    """The writer is a daemon thread: without the exit hook the process ended with the
    blocks still queued, and a stream that moved (or the worker's next process) computed
    them again."""
    folder = tmp_path / "tier"
    done = subprocess.run([sys.executable, "-c", EXITING_WRITER, str(folder)], cwd=REPO_ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(list(folder.glob("*.kv"))) == 2
