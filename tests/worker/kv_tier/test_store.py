"""The KV tier's block files: round trip, every kind of bad block is a miss (and is removed),
the byte bound under a flood, LRU order, the disk level, and the folder's permissions."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from zeroserve.worker.kv_tier.digest import ModelKey, block_digest
from zeroserve.worker.kv_tier.store import HEADER, TierLevel, TierStore

MODEL = bytes(range(16))
OTHER_MODEL = bytes(range(1, 17))
TOKENS = tuple(range(100, 116))
PAYLOAD = bytes(range(256)) * 64  # 16 KiB


def level(tmp_path: Path, max_bytes: int = 1 << 20, model: bytes = MODEL,
          name: str = "shm") -> TierLevel:
    return TierLevel(tmp_path / name, max_bytes, model)


def digest(n: int = 0) -> bytes:
    return block_digest(MODEL, tuple(range(n, n + 16)))


def test_a_published_block_reads_back_verified(tmp_path):
    tier = level(tmp_path)
    d = digest()
    assert tier.put(d, TOKENS, PAYLOAD)
    assert bytes(tier.get(d, TOKENS)) == PAYLOAD
    assert tier.get(digest(1), TOKENS) is None  # another block: a miss


def test_digests_follow_the_lineage_and_the_model(tmp_path):
    key = ModelKey("/m", 1, 2, "bfloat16", 16, 30, 3, 64).digest()
    other = ModelKey("/m", 1, 2, "float32", 16, 30, 3, 64).digest()
    first = block_digest(key, TOKENS)
    assert block_digest(key, TOKENS) == first  # the same in every process
    assert block_digest(other, TOKENS) != first
    other_cpu = ModelKey("/m", 1, 2, "bfloat16", 16, 30, 3, 64,
                         kernels="int8_activations=False,cpu_class=AVX2").digest()
    assert block_digest(other_cpu, TOKENS) != first  # other kernels: never shared
    assert block_digest(first, TOKENS) != block_digest(block_digest(key, TOKENS[::-1]), TOKENS)


def corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "torn":  # a payload byte flipped: the checksum catches it
        data[-100] ^= 0xFF
    elif how == "empty":
        data = bytearray()
    elif how == "bad_magic":
        data[:4] = b"XXXX"
    elif how == "longer":
        data += b"\0" * 10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "torn", "empty", "bad_magic", "longer"])
def test_a_damaged_block_is_a_miss_and_is_removed(tmp_path, how):
    tier = level(tmp_path)
    d = digest()
    tier.put(d, TOKENS, PAYLOAD)
    corrupt(tier.path(d), how)
    assert tier.get(d, TOKENS) is None
    assert not tier.path(d).exists()
    assert tier.counters.num_bad == 1


def test_wrong_tokens_stale_and_wrong_model_blocks_are_misses(tmp_path):
    writer = level(tmp_path)
    d = digest()
    writer.put(d, TOKENS, PAYLOAD)
    # The same digest asked for other tokens (a collision, or a planted file): a miss.
    assert writer.get(d, tuple(range(200, 216))) is None
    writer.put(d, TOKENS, PAYLOAD)
    # Another model's worker sharing the folder never takes it for its own.
    assert level(tmp_path, model=OTHER_MODEL).get(d, TOKENS) is None
    # A block filed under another digest (a stale or renamed file): a miss.
    writer.put(d, TOKENS, PAYLOAD)
    os.rename(writer.path(d), writer.path(digest(5)))
    assert writer.get(digest(5), TOKENS) is None


def _write_and_die(folder: str, stage: str) -> None:
    """A child that starts to publish a block and is SIGKILLed (os._exit stands in: no
    cleanup runs) at `stage`."""
    code = f"""
import os
from pathlib import Path
from zeroserve.worker.kv_tier import store
from zeroserve.worker.kv_tier.store import TierLevel
tier = TierLevel(Path({folder!r}), 1 << 20, bytes(range(16)))
real_write_all = store._write_all
def dying_write_all(fd, data):
    if {stage!r} == "mid_payload" and len(data) > 1000:
        os.write(fd, bytes(data)[: len(data) // 3])
        os.kill(os.getpid(), 9)
    real_write_all(fd, data)
store._write_all = dying_write_all
real_rename = os.rename
def dying_rename(a, b):
    os.kill(os.getpid(), 9)
os.rename = dying_rename if {stage!r} == "before_rename" else real_rename
tier.put({digest()!r}, {TOKENS!r}, {PAYLOAD!r})
"""
    result = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert result.returncode == -9


@pytest.mark.parametrize("stage", ["mid_payload", "before_rename"])
def test_a_writer_killed_mid_write_leaves_no_readable_block(tmp_path, stage):
    folder = tmp_path / "shm"
    level(tmp_path)  # makes the folder
    _write_and_die(str(folder), stage)
    reader = level(tmp_path)
    assert not reader.contains(digest())
    assert reader.get(digest(), TOKENS) is None
    assert reader.counters.num_bad == 0  # nothing under the block's name at all
    leftovers = [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    assert leftovers  # the dead writer's temporary file, never published
    # The next eviction scan removes a dead writer's stale temporary file.
    old = 0
    for path in leftovers:
        os.utime(path, (old, old))
    reader._evict(0)
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_the_bound_holds_under_a_flood_of_distinct_blocks(tmp_path):
    block_bytes = HEADER.size + 4 * len(TOKENS) + len(PAYLOAD)
    bound = 20 * block_bytes
    tier = level(tmp_path, max_bytes=bound)
    for n in range(200):
        assert tier.put(digest(n), TOKENS, PAYLOAD)  # a full tier evicts, never fails
        on_disk = sum(p.stat().st_size for p in tier.folder.glob("*.kv"))
        assert on_disk <= bound
    assert tier.counters.num_evictions >= 180
    assert tier.get(digest(199), TOKENS) is not None  # the newest survive
    assert tier.usage_bytes() <= bound


def test_eviction_takes_the_least_recently_used(tmp_path):
    block_bytes = HEADER.size + 4 * len(TOKENS) + len(PAYLOAD)
    tier = level(tmp_path, max_bytes=3 * block_bytes)
    for n in range(3):
        tier.put(digest(n), TOKENS, PAYLOAD)
        os.utime(tier.path(digest(n)), ns=(n * 10**9, n * 10**9))
    tier.get(digest(0), TOKENS)  # used now: the newest
    tier.put(digest(3), TOKENS, PAYLOAD)
    assert tier.contains(digest(0))
    assert not tier.contains(digest(1))  # the least recently used went


def test_two_processes_share_the_bound(tmp_path):
    """Workers of a box share one folder and one bound: the usage count is theirs together."""
    block_bytes = HEADER.size + 4 * len(TOKENS) + len(PAYLOAD)
    bound = 10 * block_bytes
    a, b = level(tmp_path, max_bytes=bound), level(tmp_path, max_bytes=bound)
    for n in range(30):
        (a if n % 2 else b).put(digest(n), TOKENS, PAYLOAD)
        assert sum(p.stat().st_size for p in a.folder.glob("*.kv")) <= bound
    assert a.get(digest(29), TOKENS) is not None


def test_a_block_larger_than_the_bound_is_dropped_not_an_error(tmp_path):
    tier = level(tmp_path, max_bytes=1000)
    assert not tier.put(digest(), TOKENS, PAYLOAD)
    assert tier.counters.num_dropped == 1


def test_the_disk_level_keeps_what_memory_evicted_and_promotes_it(tmp_path):
    block_bytes = HEADER.size + 4 * len(TOKENS) + len(PAYLOAD)
    shm = level(tmp_path, max_bytes=2 * block_bytes)
    disk = level(tmp_path, max_bytes=100 * block_bytes, name="disk")
    store = TierStore([shm, disk])
    for n in range(5):
        store.put(digest(n), TOKENS, PAYLOAD)
    assert not shm.contains(digest(0))
    assert bytes(store.get(digest(0), TOKENS)) == PAYLOAD  # from the disk
    assert shm.contains(digest(0))  # and now in memory again
    # A new process (a restarted box) finds the disk's blocks.
    again = TierStore([level(tmp_path, max_bytes=2 * block_bytes),
                       level(tmp_path, max_bytes=100 * block_bytes, name="disk")])
    assert bytes(again.get(digest(3), TOKENS)) == PAYLOAD
    assert again.counters.num_hits == 1


def test_the_folder_is_private_and_files_are_the_users_alone(tmp_path):
    tier = level(tmp_path)
    tier.put(digest(), TOKENS, PAYLOAD)
    assert tier.folder.stat().st_mode & 0o777 == 0o700
    assert tier.path(digest()).stat().st_mode & 0o777 == 0o600


def test_a_folder_others_can_enter_is_refused(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    with pytest.raises(ValueError, match="mode 700"):
        TierLevel(folder, 1 << 20, MODEL)


@pytest.mark.skipif(os.getuid() != 0 or not Path("/usr/bin/python3").exists(),
                    reason="needs root (to run as another user) and /usr/bin/python3")
def test_another_user_cannot_open_a_block():
    base = Path(tempfile.mkdtemp(prefix="kv-tier-perm-"))
    try:
        os.chmod(base, 0o755)  # everyone may reach the tier's folder: only it must refuse
        tier = TierLevel(base / "kv-tier", 1 << 20, MODEL)
        tier.put(digest(), TOKENS, PAYLOAD)
        code = (f"import os; print(os.listdir({str(base)!r})); "
                f"open({str(tier.path(digest()))!r}, 'rb').read()")
        result = subprocess.run(["/usr/bin/python3", "-c", code], user=65534, group=65534,
                                capture_output=True, timeout=60)
        assert b"kv-tier" in result.stdout  # it did reach the folder
        assert result.returncode != 0
        assert b"PermissionError" in result.stderr
    finally:
        shutil.rmtree(base)
