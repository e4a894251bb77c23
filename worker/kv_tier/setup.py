"""Turning the tier on for one worker: its folders, its model key, its connector (torch).

Off (None) when `kv_offloading_size` is 0, when the runner has no KV pool (the fake backend),
and, with one warning, when the shared-memory folder's file system cannot hold the size
asked for (a container's 64 MiB /dev/shm): a worker always starts, with or without a tier.

A CPU runner asks `allocate_pool` for its KV pool first: with the tier on and
`kv_pool_in_tier` (the default), the pool is a file in the tier's folder
(worker/kv_tier/pool_file.py) and full blocks are published without a copy; where it does
not fit (live pools past half the bound) or on CUDA, the runner allocates its own and the
connector copies blocks out after each step.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from zeroserve.worker import cpu_class
from zeroserve.worker.config import EngineConfig
from zeroserve.worker.kv_tier.connector import KVTierConnector
from zeroserve.worker.kv_tier.digest import ModelKey
from zeroserve.worker.kv_tier.pool_file import PoolFile
from zeroserve.worker.kv_tier.store import TierLevel, TierStore, default_folder
from zeroserve.worker.model.info import ModelInfo

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
    key = model_key(config, runner.info, runner.block_size,  # type: ignore[attr-defined]
                    pool.dtype, pool.device.type)
    folder = tier_folder(config)
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
    pool_file = getattr(runner, "kv_pool_file", None)
    connector = KVTierConnector(TierStore(levels), pool, key,
                                block_manager.block_tokens,  # type: ignore[attr-defined]
                                pool_file=pool_file)
    block_manager.tier = connector  # type: ignore[attr-defined]
    logger.info("KV tier on: %s (%.2f GiB)%s, %d KiB per block, %s", folder, size / GIB,
                f" over {config.kv_tier_dir} ({config.kv_tier_dir_size:g} GiB)"
                if config.kv_tier_dir else "", connector.block_bytes >> 10,
                "the pool in it (no copy)" if pool_file is not None else "blocks copied in")
    return connector


def allocate_pool(config: EngineConfig, info: ModelInfo, block_size: int,
                  shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                      PoolFile] | None:
    """A CPU KV pool of `shape` mapped from a file in the tier's folder (zeroed, committed as
    written), and that file; None where the pool is not to live in the tier (off, or it does
    not fit: the runner allocates its own)."""
    import torch

    size = int(config.kv_offloading_size * GIB)
    if size <= 0 or not config.kv_pool_in_tier:
        return None
    folder = tier_folder(config)
    room = _file_system_bytes(folder)
    if room is not None and room < size:
        return None  # attach() says why the tier is off
    key = model_key(config, info, block_size, dtype, "cpu")
    num_layers, num_kv, num_blocks = shape[:3]
    numel = math.prod(shape)
    element = torch.empty((), dtype=dtype).element_size()
    try:
        level = TierLevel(folder, size, key)
    except (OSError, ValueError):
        return None  # attach() says why the tier is off
    pool_file = level.create_pool(num_blocks, num_layers * num_kv,
                                  numel // (num_layers * num_kv * num_blocks) * element)
    if pool_file is None:
        logger.info("KV tier: the KV pool (%d MiB) does not fit in half of the tier with the "
                    "live pools there; blocks are copied in instead", numel * element >> 20)
        return None
    pool = torch.frombuffer(pool_file.mapped, dtype=dtype, count=numel,
                            offset=pool_file.data_offset).view(shape)
    return pool, pool_file


def tier_folder(config: EngineConfig) -> Path:
    return Path(config.kv_offloading_dir) if config.kv_offloading_dir else default_folder()


def model_key(config: EngineConfig, info: ModelInfo, block_size: int, kv_dtype: torch.dtype,
              device_type: str) -> bytes:
    """What a worker's blocks are named under: equal only where K/V are bit for bit equal."""
    return ModelKey.for_file(
        info.path, dtype=info.dtype, block_size=block_size, num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads, head_dim=info.head_dim, device_type=device_type,
        batch_invariant=config.batch_invariant,
        kernels=_kernels(config, kv_dtype, device_type)).digest()


def _kernels(config: EngineConfig, kv_dtype: torch.dtype, device_type: str) -> str:
    """The engine settings besides the model key's fields that change K/V's bits, and the
    pool's dtype (--kv-cache-dtype: bf16 K/V under fp32 activations are other bytes)."""
    # int8 activations take every prompt row of the layers' projections too
    # (Linear.int8_all_rows), so a prompt's K/V differ from the dense prompt rows' before.
    int8 = config.uses_int8_activations
    parts = [f"int8_activations={int8}", f"prompt_projections={'int8' if int8 else 'dense'}",
             f"kv_dtype={str(kv_dtype).removeprefix('torch.')}"]
    if device_type == "cpu":
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
