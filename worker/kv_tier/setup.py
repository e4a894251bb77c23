"""Turning the tier on for one worker: its folders, its model key, its connector (torch).

Off (None) when `kv_offloading_size` is 0, when the runner has no KV pool (the fake backend),
and, with one warning, when the shared-memory folder's file system cannot hold the size
asked for (a container's 64 MiB /dev/shm): a worker always starts, with or without a tier.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from zeroserve.worker import cpu_class
from zeroserve.worker.config import EngineConfig
from zeroserve.worker.kv_tier.connector import KVTierConnector
from zeroserve.worker.kv_tier.digest import ModelKey
from zeroserve.worker.kv_tier.store import TierLevel, TierStore, default_folder

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

GIB = 1 << 30


def attach(config: EngineConfig, runner: object, block_manager: object) -> KVTierConnector | None:
    """Make the tier of `config` and set it as block_manager's `tier`; None when it is off."""
    size = int(config.kv_offloading_size * GIB)
    if size <= 0:
        return None
    pool = getattr(runner, "kv_pool", None)
    if pool is None:
        logger.warning("KV tier: the %s runner has no KV pool; the tier is off",
                       type(runner).__name__)
        return None
    info = runner.info  # type: ignore[attr-defined]
    key = ModelKey.for_file(
        info.path, dtype=info.dtype, block_size=runner.block_size,  # type: ignore[attr-defined]
        num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
        device_type=pool.device.type, batch_invariant=config.batch_invariant,
        kernels=_kernels(config, pool)).digest()
    folder = Path(config.kv_offloading_dir) if config.kv_offloading_dir else default_folder()
    room = _file_system_bytes(folder)
    if room is not None and room < size:
        logger.warning("KV tier: %s holds %d MiB, less than --kv-offloading-size (%d MiB); "
                       "the tier is off (give the container a larger shm_size, or a smaller "
                       "size)", folder, room >> 20, size >> 20)
        return None
    try:
        levels = [TierLevel(folder, size, key)]
        if config.kv_tier_dir:
            levels.append(TierLevel(config.kv_tier_dir, int(config.kv_tier_dir_size * GIB), key))
    except (OSError, ValueError) as exc:
        logger.warning("KV tier: cannot use its folders (%s); the tier is off", exc)
        return None
    connector = KVTierConnector(TierStore(levels), pool, key,
                                block_manager.block_tokens)  # type: ignore[attr-defined]
    block_manager.tier = connector  # type: ignore[attr-defined]
    logger.info("KV tier on: %s (%.2f GiB)%s, %d KiB per block", folder, size / GIB,
                f" over {config.kv_tier_dir} ({config.kv_tier_dir_size:g} GiB)"
                if config.kv_tier_dir else "", connector.block_bytes >> 10)
    return connector


def _kernels(config: EngineConfig, pool: torch.Tensor) -> str:
    """The engine settings besides the model key's fields that change K/V's bits, and the
    pool's dtype (--kv-cache-dtype: bf16 K/V under fp32 activations are other bytes)."""
    # int8 activations take every prompt row of the layers' projections too
    # (Linear.int8_all_rows), so a prompt's K/V differ from the dense prompt rows' before.
    int8 = config.uses_int8_activations
    parts = [f"int8_activations={int8}", f"prompt_projections={'int8' if int8 else 'dense'}",
             f"kv_dtype={str(pool.dtype).removeprefix('torch.')}"]
    if pool.device.type == "cpu":
        parts.append(f"cpu_class={cpu_class.effective().cpu_class.name}")
    return ",".join(parts)


def _file_system_bytes(folder: Path) -> int | None:
    """The size of the file system `folder` is on (or would be made on), None if unknown."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        info = os.statvfs(probe)
    except OSError:
        return None
    return info.f_frsize * info.f_blocks
