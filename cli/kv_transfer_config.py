"""`--kv-transfer-config`: vLLM's JSON flag for a KV connector, read onto the box's KV tier.

What it takes (anything else is a usage error naming the field and what to use instead):

- vLLM's shape: `{"kv_connector": "OffloadingConnector" | "LMCacheConnectorV1", "kv_role":
  "kv_both", "kv_connector_extra_config": {...}}`.
- In the extra config, vLLM's OffloadingConnector fields: `cpu_bytes_to_use` (bytes),
  `spec_name` "CPUOffloadingSpec", `block_size` (only the engine's --block-size: the tier's
  blocks are the pool's); and LMCache's names, bare or with its `lmcache.` prefix:
  `local_cpu` (bool), `max_local_cpu_size` (GB, as LMCache counts them: GiB),
  `local_disk` (a path or `file://` URL), `max_local_disk_size` (GB), `chunk_size` (only
  --block-size).

They map onto the tier's flags: the memory level's size (--kv-offloading-size), the disk level
(--kv-tier-dir, --kv-tier-dir-size); `local_cpu: false` with a disk puts the tier's one level
on that disk. The tier is per box: a remote backend, disaggregated prefill (kv_producer,
kv_consumer) and the other connectors are refused with what to use instead.
"""

from __future__ import annotations

import json
import math
from typing import Any

GIB = 1 << 30
CONNECTORS = ("OffloadingConnector", "LMCacheConnectorV1")
# LMCache's defaults (its LMCacheEngineConfig), used when its connector leaves them out.
LMCACHE_DEFAULTS = {"local_cpu": True, "max_local_cpu_size": 5.0}
FLAG_OF_FIELD = {"kv_offloading_size": "--kv-offloading-size",
                 "kv_offloading_dir": "--kv-offloading-dir", "kv_tier_dir": "--kv-tier-dir",
                 "kv_tier_dir_size": "--kv-tier-dir-size"}
_REMOTE = ("the KV tier is per box (shared memory, and a disk level with local_disk); across "
           "boxes, run LMCache's remote server, Mooncake or Redis behind vLLM, or route each "
           "conversation to one box (prompt_cache_key)")
_UNSUPPORTED_EXTRA = {
    "num_cpu_blocks": "give cpu_bytes_to_use (bytes) or max_local_cpu_size (GB) instead: "
                      "a block's bytes depend on the model",
    "remote_url": _REMOTE, "remote_serde": _REMOTE, "remote_storage_plugins": _REMOTE,
    "enable_p2p": _REMOTE, "enable_pd": "disaggregated prefill is not supported; use kv_both",
    "enable_nixl": _REMOTE, "enable_blending": "CacheBlend is not supported",
    "gds_path": "GPUDirect storage is not supported; use local_disk",
}
_OFFLOADING_FIELDS = ("cpu_bytes_to_use", "spec_name", "block_size")
_LMCACHE_FIELDS = ("local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size",
                   "chunk_size")


class KVTransferConfigError(ValueError):
    """A config we cannot serve; the message names the field."""


def parse_kv_transfer_config(text: str, block_size: int) -> dict[str, Any]:
    """The JSON of --kv-transfer-config -> EngineConfig's tier fields it sets."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise KVTransferConfigError(f"not JSON: {e}") from None
    if not isinstance(config, dict):
        raise KVTransferConfigError("must be a JSON object")
    for name in config:
        if name not in ("kv_connector", "kv_role", "kv_connector_extra_config"):
            raise KVTransferConfigError(
                f"{name}: not supported (zeroserve's KV tier takes kv_connector, kv_role and "
                "kv_connector_extra_config; it moves no KV between instances)")
    connector = config.get("kv_connector")
    if connector not in CONNECTORS:
        raise KVTransferConfigError(
            f"kv_connector: {connector!r} is not supported; use one of {', '.join(CONNECTORS)} "
            f"(the box's KV tier: host memory, then disk). For other connectors: {_REMOTE}")
    role = config.get("kv_role", "kv_both")
    if role != "kv_both":
        raise KVTransferConfigError(
            f"kv_role: {role!r} is not supported; use kv_both (every worker writes and reads "
            "the tier; disaggregated prefill, kv_producer/kv_consumer, is not built)")
    extra = config.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise KVTransferConfigError("kv_connector_extra_config: must be a JSON object")
    fields = _extra_fields(extra, block_size)
    if connector == "LMCacheConnectorV1":
        fields = {**LMCACHE_DEFAULTS, **fields}
    return _tier_fields(fields)


def _extra_fields(extra: dict[str, Any], block_size: int) -> dict[str, Any]:
    """The extra config's fields by their bare names, each checked."""
    fields: dict[str, Any] = {}
    for key, value in extra.items():
        name = key.removeprefix("lmcache.")
        where = f"kv_connector_extra_config.{key}"
        if name in _UNSUPPORTED_EXTRA:
            raise KVTransferConfigError(f"{where}: not supported: {_UNSUPPORTED_EXTRA[name]}")
        if name not in _OFFLOADING_FIELDS + _LMCACHE_FIELDS:
            raise KVTransferConfigError(
                f"{where}: not supported (zeroserve reads "
                f"{', '.join(_OFFLOADING_FIELDS + _LMCACHE_FIELDS)})")
        if name in ("block_size", "chunk_size"):
            if value != block_size:
                raise KVTransferConfigError(
                    f"{where}: {value!r}: the tier keeps the KV pool's blocks of --block-size "
                    f"tokens ({block_size}); leave it out or set --block-size")
            continue
        if name == "spec_name":
            if value != "CPUOffloadingSpec":
                raise KVTransferConfigError(
                    f"{where}: {value!r} is not supported; leave it out (CPUOffloadingSpec) "
                    "and give a disk level with local_disk")
            continue
        if name == "local_cpu":
            if not isinstance(value, bool):
                raise KVTransferConfigError(f"{where}: must be true or false")
        elif name == "local_disk":
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise KVTransferConfigError(f"{where}: must be a folder (a path or file:// URL)")
            if isinstance(value, str) and "://" in value and not value.startswith("file://"):
                raise KVTransferConfigError(f"{where}: {value!r}: only a local folder; {_REMOTE}")
        else:  # a size
            scale = 1 / GIB if name == "cpu_bytes_to_use" else 1.0
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value) or value < 0:
                raise KVTransferConfigError(f"{where}: must be a number >= 0")
            value = value * scale
            name = "max_local_cpu_size" if name == "cpu_bytes_to_use" else name
        fields[name] = value
    return fields


def _tier_fields(fields: dict[str, Any]) -> dict[str, Any]:
    disk = fields.get("local_disk")
    if isinstance(disk, str):
        disk = disk.removeprefix("file://") or None
    cpu_size = fields.get("max_local_cpu_size")
    out: dict[str, Any] = {}
    if fields.get("local_cpu", True):
        if cpu_size is None:
            raise KVTransferConfigError(
                "kv_connector_extra_config.cpu_bytes_to_use (or max_local_cpu_size): the "
                "tier's size is required")
        out["kv_offloading_size"] = float(cpu_size)
        if disk is not None:
            out["kv_tier_dir"] = disk
            if "max_local_disk_size" in fields:
                out["kv_tier_dir_size"] = float(fields["max_local_disk_size"])
    elif disk is not None:  # the disk is the tier's only level
        if "max_local_disk_size" not in fields:
            raise KVTransferConfigError(
                "kv_connector_extra_config.max_local_disk_size: required with local_cpu false "
                "(the disk is then the tier's one level)")
        out["kv_offloading_dir"] = disk
        out["kv_offloading_size"] = float(fields["max_local_disk_size"])
    else:
        out["kv_offloading_size"] = 0.0  # neither level: the tier is off
    if out["kv_offloading_size"] > 0 and out.get("kv_tier_dir_size", 1.0) <= 0:
        raise KVTransferConfigError("kv_connector_extra_config.max_local_disk_size: must be "
                                    "> 0 with local_disk")
    return out


def merge_with_flags(parsed: dict[str, Any], flags: dict[str, Any],
                     defaults: dict[str, Any]) -> dict[str, Any]:
    """The tier's fields from --kv-transfer-config over the flags: a flag left at its default
    gives way; one set to another value is an error (two answers to one question)."""
    merged = dict(flags)
    for name, value in parsed.items():
        if flags[name] != defaults[name] and flags[name] != value:
            raise KVTransferConfigError(
                f"{FLAG_OF_FIELD[name]} {flags[name]} and --kv-transfer-config's {value} "
                "disagree; give one of them")
        merged[name] = value
    return merged
