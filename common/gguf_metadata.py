"""Read a GGUF file's key/value metadata (not its tensors), fast.

The `gguf` package's reader also maps every tensor, which takes seconds; the gateway only
needs the tokenizer keys. Layout (little endian): magic "GGUF", u32 version, u64 tensor
count, u64 kv count, then kv pairs: string key, u32 value type, value. Strings are a u64
length and UTF-8 bytes; arrays are u32 item type, u64 count, items.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_ITEMS = 10_000_000  # guards a corrupt count from allocating the world


class GGUFFormatError(ValueError):
    pass


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFFormatError(f"{path} is not a GGUF file")
        (version,) = struct.unpack("<I", f.read(4))
        if version < 2:
            raise GGUFFormatError(f"GGUF version {version} is not supported")
        _num_tensors, num_kv = struct.unpack("<QQ", f.read(16))
        out = {}
        for _ in range(num_kv):
            key = _read_string(f)
            (value_type,) = struct.unpack("<I", f.read(4))
            out[key] = _read_value(f, value_type)
        return out


def _read_string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, value_type: int) -> Any:
    if value_type == _STRING:
        return _read_string(f)
    if value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if count > _MAX_ITEMS:
            raise GGUFFormatError(f"array of {count} items")
        if item_type in _SCALARS:  # one read for the whole array
            fmt = _SCALARS[item_type]
            size = struct.calcsize(fmt)
            return list(struct.unpack(f"<{count}{fmt[1]}", f.read(size * count)))
        return [_read_value(f, item_type) for _ in range(count)]
    if value_type in _SCALARS:
        fmt = _SCALARS[value_type]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    raise GGUFFormatError(f"unknown GGUF value type {value_type}")
