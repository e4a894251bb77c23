"""Lineage digests of full KV blocks, shared by every worker of a box. Standard library only.

The block manager's prefix-cache hash (`chain_hash`) uses Python's hash() rooted in a random
number per process: it cannot name a block to another process. The tier names a block by
blake2b over (its parent's digest, its token ids), rooted in the model key, so two workers
serving the same model file, dtype, block size and KV shapes name the same block alike, and
no block of another model or layout can ever be taken for it.
"""

from __future__ import annotations

import hashlib
import os
import struct
from array import array
from dataclasses import dataclass

DIGEST_BYTES = 16
# Bump when what a block's bytes mean changes (pool layout, rounding of the kernels).
KV_FORMAT_VERSION = 1


@dataclass(frozen=True)
class ModelKey:
    """What must be equal for two workers' KV blocks of the same tokens to be equal."""

    model_path: str
    model_size: int
    model_mtime_ns: int
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    device_type: str = "cpu"
    batch_invariant: bool = False
    # What else decides the kernels that compute K/V (the CPU class, int8 activations):
    # workers that differ there agree to rounding only, so they do not share blocks.
    kernels: str = ""

    @classmethod
    def for_file(cls, path: str, **fields: object) -> ModelKey:
        """A key for the model at `path` (a file, or a directory's files together)."""
        real = os.path.realpath(path)
        size, mtime_ns = _identity(real)
        return cls(real, size, mtime_ns, **fields)  # type: ignore[arg-type]

    def digest(self) -> bytes:
        text = repr((KV_FORMAT_VERSION, self.model_path, self.model_size, self.model_mtime_ns,
                     self.dtype, self.block_size, self.num_layers, self.num_kv_heads,
                     self.head_dim, self.device_type, self.batch_invariant, self.kernels))
        return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest()


def _identity(path: str) -> tuple[int, int]:
    """(bytes, newest mtime) of a file, or of the files of a directory (a HF model)."""
    if os.path.isdir(path):
        size = mtime = 0
        for name in sorted(os.listdir(path)):
            info = os.stat(os.path.join(path, name))
            size += info.st_size
            mtime = max(mtime, info.st_mtime_ns)
        return size, mtime
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns


def block_digest(parent: bytes, token_ids: tuple[int, ...] | list[int]) -> bytes:
    """The digest of a full block after `parent` (the model key's digest for a first block)."""
    tokens = array("I", token_ids).tobytes()
    return hashlib.blake2b(parent + struct.pack("<I", len(token_ids)) + tokens,
                           digest_size=DIGEST_BYTES).digest()


def tokens_bytes(token_ids: tuple[int, ...] | list[int]) -> bytes:
    """A block's token ids as stored in its header (little-endian u32)."""
    packed = array("I", token_ids)
    if packed.itemsize != 4:  # pragma: no cover - every platform we run on
        raise RuntimeError("unsigned int is not 4 bytes here")
    return packed.tobytes()
