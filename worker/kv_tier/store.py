"""The tier's storage: one file per KV block in a private folder, bounded in bytes, shared by
every worker of the box. Standard library only (payloads are bytes-like; connector.py turns
them into tensors).

A block's file is `<digest hex>.kv`:

    header  magic b"ZSKV", format version, model key digest, block digest, token count,
            payload length, crc32 of the payload          (struct HEADER)
    tokens  the block's token ids, u32 each
    payload the block's K/V for every layer

Crash consistency: a block is written under a temporary name (`.<digest>.<pid>.<n>.tmp`),
flushed, and published by rename(), which is atomic: a writer killed at any moment leaves a
temporary file (removed by the next eviction scan once stale) or a whole block, never a half
block under a block's name. Every read verifies the header (magic, version, model, digest,
tokens, length) and the payload's crc32; any mismatch is a miss and the file is removed.

Bound and eviction: `usage` (a small file beside the blocks) counts the bytes published, under
an flock shared by all processes; a put that would pass the bound first scans the folder and
removes the least recently used blocks (mtime: touched on every hit) down to 90% of it. The
count is raised before the rename, so a writer killed between them only overcounts, which
the next scan heals. A full tier evicts, it never fails a put; a put larger than the whole
bound is dropped.

A CPU worker's pool may live in the folder itself (pool_file.py, a `.kvpool` file): its
blocks are published as entries under the same names with the same header and the crc32 of
the block's bytes, but instead of the payload they name (pool file, block, generation). A
reader copies the block out of the pool file and verifies it (generation and crc32): a block
the owner reused since is a miss, removed like a torn one. Pool files count in `usage` by
their whole size; eviction takes a pool file only from a dead process (it must be able to
lock it exclusively: a live owner holds a shared lock), least recently read first.

Permissions: the folder is made mode 700 and must be this user's and closed to others (the
ipc:// plane's model, common/runtime_dir.py); files are created 600.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import mmap
import os
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from zeroserve.common.runtime_dir import is_private_dir, make_private_dirs, runtime_dir
from zeroserve.worker.kv_tier import pool_file
from zeroserve.worker.kv_tier.digest import DIGEST_BYTES, tokens_bytes
from zeroserve.worker.kv_tier.pool_file import POOL_ID_BYTES, POOL_SUFFIX, PoolFile

logger = logging.getLogger(__name__)

MAGIC = b"ZSKV"
REF_MAGIC = b"ZSKR"  # an entry whose payload lives in a worker's pool file (pool_file.py)
FILE_VERSION = 1
# magic, version, model key, block digest, num tokens, payload bytes, crc32 of the payload
HEADER = struct.Struct(f"<4sH{DIGEST_BYTES}s{DIGEST_BYTES}sIQI")
# After an entry's tokens: its pool file's id, the block's index there, its generation.
REF = struct.Struct(f"<{POOL_ID_BYTES}sIQ")
# A worker's pool lives in the tier only while the live pools, its own included, take at
# most this share of the bound: the rest keeps blocks and dead workers' pools readable.
POOL_SHARE = 0.5
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
# A temporary file older than this is a dead writer's: the eviction scan removes it.
STALE_TMP_S = 60.0
LOW_WATERMARK = 0.9  # an eviction scan frees down to this share of the bound


@dataclass
class TierCounters:
    """Cumulative, per process."""

    num_hits: int = 0  # blocks found and verified (TierStore.get)
    num_misses: int = 0  # blocks looked up and not found, or found bad (TierStore.get)
    num_bad: int = 0  # blocks found bad (torn, stale, wrong model, bad checksum) and removed
    num_puts: int = 0  # blocks published
    num_dropped: int = 0  # blocks not written (queue full, too large, I/O error)
    bytes_written: int = 0
    bytes_read: int = 0
    num_evictions: int = 0  # blocks this process removed to keep the bound
    load_s: float = 0.0  # seconds reading and verifying blocks (TierStore.get)


def kv_tier_counters(counters: TierCounters | None) -> dict[str, int]:
    """A worker's tier figures as HEARTBEAT counters (common/protocol.py's
    KV_TIER_COUNTER_NAMES); none with the tier off."""
    if counters is None:
        return {}
    return {"kv_tier_hits": counters.num_hits, "kv_tier_misses": counters.num_misses,
            "kv_tier_read_bytes": counters.bytes_read,
            "kv_tier_written_bytes": counters.bytes_written,
            "kv_tier_evictions": counters.num_evictions,
            "kv_tier_load_microseconds": int(counters.load_s * 1e6)}


def default_folder() -> Path:
    """/dev/shm/zeroserve-$UID/kv-tier where /dev/shm exists, else the runtime dir's."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm / f"zeroserve-{os.getuid()}" / "kv-tier"
    return runtime_dir() / "kv-tier"


def open_private_folder(folder: str | Path) -> Path:
    """Make `folder` (mode 700) or check the one there; ValueError if others can enter it."""
    folder = make_private_dirs(folder)
    if not is_private_dir(folder):
        raise ValueError(f"KV tier folder {folder} must be this user's and mode 700 "
                         "(others could read or plant KV blocks)")
    return folder


class TierLevel:
    """One folder of block files with its own bound (shared memory, or the disk below it)."""

    def __init__(self, folder: str | Path, max_bytes: int, model_key: bytes,
                 counters: TierCounters | None = None) -> None:
        if max_bytes < 1:
            raise ValueError("a tier level's size must be at least one byte")
        if len(model_key) != DIGEST_BYTES:
            raise ValueError(f"model key must be {DIGEST_BYTES} bytes")
        self.folder = open_private_folder(folder)
        self.max_bytes = max_bytes
        self.model_key = model_key
        self.counters = counters if counters is not None else TierCounters()
        self._tmp_ids = itertools.count()
        self._lock_path = self.folder / "lock"
        self._usage_path = self.folder / "usage"

    # ---- names --------------------------------------------------------------------------

    def path(self, digest: bytes) -> Path:
        return self.folder / (digest.hex() + SUFFIX)

    def contains(self, digest: bytes) -> bool:
        """A cheap look: a file is published under the digest (not yet verified)."""
        return os.path.exists(self.path(digest))

    # ---- write ----------------------------------------------------------------------------

    def put(self, digest: bytes, token_ids: tuple[int, ...] | list[int],
            payload: bytes | bytearray | memoryview) -> bool:
        """Publish a block (a no-op if it is there already). False if it was not written."""
        final = self.path(digest)
        if os.path.exists(final):
            return True
        view = memoryview(payload).cast("B")
        header = HEADER.pack(MAGIC, FILE_VERSION, self.model_key, digest, len(token_ids),
                             view.nbytes, zlib.crc32(view))
        return self._publish(digest, header + tokens_bytes(token_ids), view)

    def put_ref(self, digest: bytes, token_ids: tuple[int, ...] | list[int], payload_len: int,
                crc: int, pool: PoolFile, block: int, generation: int) -> bool:
        """Publish a block that stays in `pool` (a file of this folder) as an entry naming it,
        in place of any entry there (which may name a block reused since). False if it was
        not written."""
        header = HEADER.pack(REF_MAGIC, FILE_VERSION, self.model_key, digest, len(token_ids),
                             payload_len, crc)
        data = header + tokens_bytes(token_ids) + REF.pack(pool.pool_id, block, generation)
        return self._publish(digest, data)

    def _publish(self, digest: bytes, *parts: bytes | memoryview) -> bool:
        """Write parts under a temporary name, count them, rename into place (over what was
        there: only its size is counted again, less what it replaces)."""
        final = self.path(digest)
        size = sum(memoryview(part).nbytes for part in parts)
        try:
            replaced = os.stat(final).st_size
        except OSError:
            replaced = 0
        if size > self.max_bytes:
            self.counters.num_dropped += 1
            return False
        tmp = self.folder / f".{digest.hex()}.{os.getpid()}.{next(self._tmp_ids)}{TMP_SUFFIX}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                for part in parts:
                    _write_all(fd, part)
            finally:
                os.close(fd)
            self._reserve(size - replaced)  # counted before it is visible: a crash only
            os.rename(tmp, final)  # overcounts, which the next eviction scan heals
        except OSError as exc:
            logger.warning("KV tier: could not write a block to %s: %s", self.folder, exc)
            _unlink(tmp)
            self.counters.num_dropped += 1
            return False
        self.counters.num_puts += 1
        self.counters.bytes_written += size
        return True

    def create_pool(self, num_blocks: int, num_slabs: int, slab_bytes: int) -> PoolFile | None:
        """A pool file for this process's KV pool, counted in the bound; None when it would
        take the live pools past POOL_SHARE of the bound (or cannot be made)."""
        size = pool_file.file_bytes(num_blocks, num_slabs, slab_bytes)
        with self._locked() as fd:
            if self._live_pool_bytes() + size > self.max_bytes * POOL_SHARE:
                return None
            try:
                pool = PoolFile(self.folder, self.model_key, num_blocks, num_slabs, slab_bytes)
            except OSError as exc:
                logger.warning("KV tier: cannot make a pool file in %s: %s", self.folder, exc)
                return None
            self._reserve_locked(fd, size)
        return pool

    def _live_pool_bytes(self) -> int:
        total = 0
        for path in self.folder.glob("*" + POOL_SUFFIX):
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if pool_file.is_live(path):
                total += size
        return total

    # ---- read -----------------------------------------------------------------------------

    def get(self, digest: bytes, token_ids: tuple[int, ...] | list[int]) -> memoryview | None:
        """The payload of a verified block (a view of its file, mapped copy-on-write: writing
        to it changes nothing shared), or None: a miss. A block that fails verification is
        removed."""
        path = self.path(digest)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else None
        except (OSError, ValueError):
            mapped = None
        finally:
            os.close(fd)
        payload = None if mapped is None else self._verify(mapped, digest, token_ids)
        if payload is None:
            is_ref = mapped is not None and mapped[:len(REF_MAGIC)] == REF_MAGIC
            if mapped is not None:
                mapped.close()
            self.counters.num_bad += 1
            if is_ref:
                # Mostly a block its owner reused since (or a dead owner's evicted pool).
                logger.debug("KV tier: removed a stale pool entry %s", path.name)
            else:
                logger.warning("KV tier: removed a bad block %s", path.name)
            _unlink(path)
            return None
        try:
            os.utime(path)  # least recently used goes first
        except OSError:
            pass  # evicted meanwhile: the mapping stays valid
        return payload

    def _verify(self, mapped: mmap.mmap, digest: bytes,
                token_ids: tuple[int, ...] | list[int]) -> memoryview | None:
        if len(mapped) < HEADER.size:
            return None
        magic, version, model_key, stored_digest, num_tokens, payload_len, crc = \
            HEADER.unpack_from(mapped, 0)
        if (magic not in (MAGIC, REF_MAGIC) or version != FILE_VERSION
                or model_key != self.model_key or stored_digest != digest
                or num_tokens != len(token_ids)):
            return None
        start = HEADER.size + 4 * num_tokens
        if len(mapped) != start + (REF.size if magic == REF_MAGIC else payload_len):
            return None  # truncated, or more than a block
        if mapped[HEADER.size:start] != tokens_bytes(token_ids):
            return None
        if magic == REF_MAGIC:
            pool_id, block, generation = REF.unpack_from(mapped, start)
            return pool_file.read_block(self.folder, pool_id, self.model_key, block,
                                        generation, payload_len, crc)
        payload = memoryview(mapped)[start:]
        if zlib.crc32(payload) != crc:
            payload.release()
            return None
        return payload

    # ---- bound -----------------------------------------------------------------------------

    def usage_bytes(self) -> int:
        """The bytes of published blocks, as counted (at least what is there)."""
        with self._locked() as fd:
            return _read_usage(fd)

    def _reserve(self, size: int) -> None:
        with self._locked() as fd:
            self._reserve_locked(fd, size)

    def _reserve_locked(self, fd: int, size: int) -> None:
        used = _read_usage(fd)
        if size > 0 and used + size > self.max_bytes:
            used = self._evict(int(self.max_bytes * LOW_WATERMARK) - size)
        _write_usage(fd, used + size)

    def _evict(self, target: int) -> int:
        """Remove least recently used blocks and dead workers' pool files until at most
        `target` bytes remain (and dead writers' stale temporary files); the bytes that
        remain, live pools included. Called under the lock."""
        files = []
        total = 0
        now = time.time()
        with os.scandir(self.folder) as entries:
            for entry in entries:
                name = entry.name
                try:
                    info = entry.stat()
                except OSError:
                    continue
                if name.endswith(TMP_SUFFIX):
                    if now - info.st_mtime > STALE_TMP_S:
                        _unlink(Path(entry.path))
                    continue
                if name.endswith(SUFFIX):
                    files.append((info.st_mtime_ns, name, info.st_size))
                    total += info.st_size
                elif name.endswith(POOL_SUFFIX):
                    total += info.st_size
                    if not pool_file.is_live(Path(entry.path)):  # a live one is never taken
                        files.append((info.st_mtime_ns, name, info.st_size))
        files.sort()  # oldest first
        for _, name, size in files:
            if total <= target:
                break
            if _unlink(self.folder / name):
                self.counters.num_evictions += 1
            total -= size
        return max(total, 0)

    def _locked(self) -> _Flock:
        return _Flock(self._lock_path)


class _Flock:
    """An exclusive flock on the lock file, with the usage file open for the holder."""

    def __init__(self, lock_path: Path) -> None:
        self._lock_path = lock_path
        self._lock_fd = -1
        self._usage_fd = -1

    def __enter__(self) -> int:
        self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self._usage_fd = os.open(self._lock_path.with_name("usage"),
                                 os.O_RDWR | os.O_CREAT, 0o600)
        return self._usage_fd

    def __exit__(self, *exc: object) -> None:
        os.close(self._usage_fd)
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)


def _read_usage(fd: int) -> int:
    data = os.pread(fd, 8, 0)
    return struct.unpack("<q", data)[0] if len(data) == 8 else 0


def _write_usage(fd: int, value: int) -> None:
    os.pwrite(fd, struct.pack("<q", max(value, 0)), 0)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view.nbytes:
        written = os.write(fd, view)
        view = view[written:]


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


class TierStore:
    """The levels of a box's tier, fastest first: shared memory, then the disk if given.

    A put is written to every level (write-through: the disk keeps what shared memory
    evicts, and survives a restart of the box); a get tries each level in order and copies
    a block found below the first one up into it."""

    def __init__(self, levels: list[TierLevel]) -> None:
        if not levels:
            raise ValueError("a tier store needs at least one level")
        self.levels = levels
        self.counters = levels[0].counters
        for level in levels[1:]:
            level.counters = self.counters  # one set of figures for the worker

    def contains(self, digest: bytes) -> bool:
        return any(level.contains(digest) for level in self.levels)

    def put(self, digest: bytes, token_ids: tuple[int, ...] | list[int],
            payload: bytes | bytearray | memoryview) -> bool:
        written = [level.put(digest, token_ids, payload) for level in self.levels]
        return any(written)

    def put_ref(self, digest: bytes, token_ids: tuple[int, ...] | list[int], crc: int,
                pool: PoolFile, block: int, generation: int,
                payload: bytes | None = None) -> bool:
        """Publish a block of `pool` (in the first level's folder) as an entry there, and its
        bytes (`payload`, needed only with more levels) in the levels below."""
        payload_len = pool.num_slabs * pool.slab_bytes
        written = [self.levels[0].put_ref(digest, token_ids, payload_len, crc, pool, block,
                                          generation)]
        if payload is not None:
            written += [level.put(digest, token_ids, payload) for level in self.levels[1:]]
        return any(written)

    def get(self, digest: bytes, token_ids: tuple[int, ...] | list[int]) -> memoryview | None:
        """A verified block's payload from the first level holding it, or None (a miss)."""
        started = time.perf_counter()
        counters = self.counters
        for index, level in enumerate(self.levels):
            payload = level.get(digest, token_ids)
            if payload is not None:
                if index:
                    self.levels[0].put(digest, token_ids, payload)  # promote
                counters.num_hits += 1
                counters.bytes_read += payload.nbytes
                counters.load_s += time.perf_counter() - started
                return payload
        counters.num_misses += 1
        counters.load_s += time.perf_counter() - started
        return None
