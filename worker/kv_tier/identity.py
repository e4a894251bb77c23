"""The box's KV tier as the gateway's routing sees it: which workers share one, and its size.

A worker names its tier in its HELLO (`kv_tier`, `kv_tier_num_blocks`). Two workers share a
tier when they open the same folder (the same inode of the same file system under the same
running kernel, whatever path each was given: containers that mount one shared-memory folder
share it, two boxes never do) with the same model key (a block of one model is never read by
another, worker/kv_tier/digest.py). The name is a digest of those; it says nothing of the
path. Torch-free: it reads the connector's store and key only.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path
from typing import Any

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def tier_identity(folder: str | Path, model_key: bytes) -> str:
    """A short opaque name of the tier in `folder` for blocks of `model_key`."""
    info = os.stat(folder)
    digest = hashlib.blake2b(digest_size=8)
    for part in (_kernel_id(), str(info.st_dev), str(info.st_ino)):
        digest.update(part.encode() + b"\0")
    digest.update(model_key)
    return digest.hexdigest()


def hello_fields(tier: Any) -> dict[str, Any]:
    """HELLO's kv_tier fields for a worker with this connector (worker/kv_tier/connector.py);
    none (the defaults: no tier) when it is None."""
    if tier is None:
        return {}
    levels = tier.store.levels
    num_bytes = sum(level.max_bytes for level in levels)
    try:
        identity = tier_identity(levels[0].folder, tier.model_key)
    except OSError:  # its folder went away: reads miss, and routing counts no tier
        return {}
    return {"kv_tier": identity, "kv_tier_num_blocks": num_bytes // max(1, tier.block_bytes)}


def _kernel_id() -> str:
    """The running kernel (one box; containers on it share it), else the host name."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return socket.gethostname()
