"""A CPU worker's KV pool as a file in the tier's folder, so that its full blocks are
published without copying them. Standard library only (setup.py wraps the mapping in a
tensor).

The file `<pool id hex>.kvpool`:

    page 0   magic b"ZSKP", format version, model key digest, num_blocks, num_slabs,
             slab_bytes, data offset                          (struct POOL_HEADER)
    page 1.. one u64 generation per block
    data     the pool tensor [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]:
             block b of slab s (s = layer * 2 + k/v) at data + (s * num_blocks + b) * slab

The owner maps it shared and holds a shared flock on it while it lives (its death, SIGKILL
included, drops the lock): eviction (store.py) takes a pool file only when it can lock it
exclusively, so a live worker's pool is never removed, and a dead one's stays readable until
the bound needs its room.

Generations (a seqlock): the owner bumps a block's generation when its block manager takes the
block for new contents, before anything is written into it. A published block names the
generation it had; a reader checks it before and after copying, and the crc32 of what it
copied: a block the owner reused since is a miss, never another block's K/V.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import struct
import zlib
from pathlib import Path

from zeroserve.worker.kv_tier.digest import DIGEST_BYTES

POOL_MAGIC = b"ZSKP"
POOL_VERSION = 1
POOL_SUFFIX = ".kvpool"
POOL_ID_BYTES = 16
# magic, version, model key, num_blocks, num_slabs, slab_bytes, data offset
POOL_HEADER = struct.Struct(f"<4sH{DIGEST_BYTES}sIIIQ")
PAGE = 4096
GENERATIONS_OFFSET = PAGE
GENERATION = struct.Struct("<Q")


def pool_path(folder: Path, pool_id: bytes) -> Path:
    return folder / (pool_id.hex() + POOL_SUFFIX)


def file_bytes(num_blocks: int, num_slabs: int, slab_bytes: int) -> int:
    """The size of a pool file of this layout."""
    return _data_offset(num_blocks) + num_blocks * num_slabs * slab_bytes


def _data_offset(num_blocks: int) -> int:
    return -(-(GENERATIONS_OFFSET + GENERATION.size * num_blocks) // PAGE) * PAGE


class PoolFile:
    """The owner's side: the mapped file, its generations, the lock that marks it live."""

    def __init__(self, folder: Path, model_key: bytes, num_blocks: int, num_slabs: int,
                 slab_bytes: int) -> None:
        """Create the file (mode 600) and lock it; call under the tier's lock, so that no
        eviction scan sees it before it is locked."""
        self.pool_id = secrets.token_bytes(POOL_ID_BYTES)
        self.path = pool_path(folder, self.pool_id)
        self.num_blocks = num_blocks
        self.num_slabs = num_slabs
        self.slab_bytes = slab_bytes
        self.data_offset = _data_offset(num_blocks)
        self.size = file_bytes(num_blocks, num_slabs, slab_bytes)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held until this process ends (fd never closed)
            os.ftruncate(fd, self.size)  # reads as zeros; pages are committed as written
            self.mapped = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED,
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink(self.path)
            raise
        self._fd = fd
        self.mapped[:POOL_HEADER.size] = POOL_HEADER.pack(
            POOL_MAGIC, POOL_VERSION, model_key, num_blocks, num_slabs, slab_bytes,
            self.data_offset)
        view = memoryview(self.mapped)
        self._generations = view[GENERATIONS_OFFSET:
                                 GENERATIONS_OFFSET + GENERATION.size * num_blocks].cast("Q")
        self._view = view

    def bump(self, block: int) -> None:
        """Block `block` is taken for new contents: what was published of it is stale."""
        self._generations[block] += 1

    def generation(self, block: int) -> int:
        return self._generations[block]

    def slabs(self, block: int) -> list[memoryview]:
        """Block `block`'s bytes, one view per (layer, k/v), in the order published."""
        return _slabs(self._view, self.data_offset, self.num_blocks, self.num_slabs,
                      self.slab_bytes, block)

    def crc(self, block: int) -> int:
        value = 0
        for slab in self.slabs(block):
            value = zlib.crc32(slab, value)
        return value

    def block_bytes(self, block: int) -> bytes:
        """A copy of the block's bytes (for a level that keeps payloads: the disk)."""
        return b"".join(self.slabs(block))

    def touch(self) -> None:
        """Mark the pool recently used (eviction takes dead pools least recently used first)."""
        try:
            os.utime(self.path)
        except OSError:
            pass

    def close(self) -> None:
        """Unmap and unlock, as this process's end does: the file is a dead pool from now
        on (readable until evicted). Only once no tensor holds the mapping."""
        self._generations.release()
        self._view.release()
        self.mapped.close()  # its own duplicate of the fd shares the lock
        os.close(self._fd)


def read_block(folder: Path, pool_id: bytes, model_key: bytes, block: int, generation: int,
               payload_len: int, crc: int) -> memoryview | None:
    """A copy of block `block` of the pool file `pool_id`, or None when the file is gone or
    is not that model's, or the block was reused since it was published (its generation or
    crc32 differ)."""
    try:
        fd = os.open(pool_path(folder, pool_id), os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size >= PAGE else None
    except (OSError, ValueError):
        mapped = None
    finally:
        os.close(fd)
    if mapped is None:
        return None
    try:
        payload = _read_mapped(mapped, model_key, block, generation, payload_len, crc)
    finally:
        try:
            mapped.close()
        except BufferError:  # a view still held after an error: unmapped when it goes
            pass
    if payload is not None:
        try:
            os.utime(pool_path(folder, pool_id))  # a dead owner's pool: read recently
        except OSError:
            pass
    return payload


def _read_mapped(mapped: mmap.mmap, model_key: bytes, block: int, generation: int,
                 payload_len: int, crc: int) -> memoryview | None:
    magic, version, key, num_blocks, num_slabs, slab_bytes, data_offset = \
        POOL_HEADER.unpack_from(mapped, 0)
    if (magic != POOL_MAGIC or version != POOL_VERSION or key != model_key
            or block >= num_blocks or num_slabs * slab_bytes != payload_len
            or data_offset != _data_offset(num_blocks)
            or len(mapped) != file_bytes(num_blocks, num_slabs, slab_bytes)):
        return None
    at = GENERATIONS_OFFSET + GENERATION.size * block
    if GENERATION.unpack_from(mapped, at)[0] != generation:
        return None  # reused since: do not even copy it
    out = bytearray(payload_len)
    target = memoryview(out)
    with memoryview(mapped) as view:
        for index, slab in enumerate(_slabs(view, data_offset, num_blocks, num_slabs,
                                            slab_bytes, block)):
            with slab:
                target[index * slab_bytes:(index + 1) * slab_bytes] = slab
    # The owner bumps the generation before it writes the block again: a copy taken while it
    # did shows the new generation now (and its crc32 would differ too).
    if GENERATION.unpack_from(mapped, at)[0] != generation or zlib.crc32(out) != crc:
        return None
    return target


def _slabs(view: memoryview, data_offset: int, num_blocks: int, num_slabs: int,
           slab_bytes: int, block: int) -> list[memoryview]:
    starts = (data_offset + (slab * num_blocks + block) * slab_bytes
              for slab in range(num_slabs))
    return [view[start:start + slab_bytes] for start in starts]


def is_live(path: Path) -> bool:
    """Whether a process still holds this pool file (its shared lock); False if it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # drops the exclusive lock, if taken
    return False


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
