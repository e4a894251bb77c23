"""Stored responses (`store: true`): what `previous_response_id` and `GET/DELETE
/v1/responses/{id}` read.

A folder of small JSON files, one per response, under one sub-folder per API key (a digest
of it): a key reads only its own responses, and every gateway of a tier (`serve --gateways
N`) that shares the folder finds a response whichever gateway made it. Bounded twice, per key:
a response older than `max_age_s` is gone (deleted when met), and beyond `max_per_key`
responses the oldest go. Writes are atomic (a temporary file renamed), so a reader never sees
half a response. The methods do file I/O: callers run them off the event loop.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from zeroserve.gateway.config import check_private_dir, make_private_dirs

_ID = re.compile(r"^resp_[0-9a-f]{32}$")
PUBLIC_OWNER = "public"  # without API keys every client is the same one


def owner_of(api_key: str | None) -> str:
    """A folder name for an API key's responses (a digest: the folder never shows a key)."""
    if api_key is None:
        return PUBLIC_OWNER
    return hashlib.sha256(b"zeroserve-responses\0" + api_key.encode()).hexdigest()[:32]


def is_response_id(value: str) -> bool:
    return bool(_ID.match(value))


class ResponseStore:
    def __init__(self, folder: str | Path, max_per_key: int = 1000,
                 max_age_s: float = 24 * 3600.0, max_record_bytes: int = 16 * 1024 * 1024,
                 clock=time.time):
        self.folder = Path(folder)
        self.max_per_key = max_per_key
        self.max_age_s = max_age_s
        self.max_record_bytes = max_record_bytes
        self.clock = clock
        self._is_checked = False

    def _check_folder(self) -> None:
        """Create the folder (mode 700, and so are the parents it makes: the default one is
        under the ipc:// folder, which may not exist yet) and refuse one that others could
        read or plant responses in (InsecurePlaneError), once."""
        if not self._is_checked:
            make_private_dirs(self.folder)
            check_private_dir(self.folder)
            self._is_checked = True

    def describe_bounds(self) -> str:
        return (f"stored responses are kept for {self.max_age_s / 3600:g} hours, the newest "
                f"{self.max_per_key} per API key")

    def _path(self, owner: str, response_id: str) -> Path:
        if not is_response_id(response_id):
            raise ValueError("not a response id")
        return self.folder / owner / f"{response_id}.json"

    def put(self, owner: str, response_id: str, record: dict[str, Any]) -> bool:
        """Store a record; False when it is larger than a record may be (not stored)."""
        data = json.dumps({"stored_at": self.clock(), **record}, ensure_ascii=False,
                          separators=(",", ":")).encode()
        if len(data) > self.max_record_bytes:
            return False
        path = self._path(owner, response_id)
        self._check_folder()
        path.parent.mkdir(exist_ok=True, mode=0o700)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        self._evict(path.parent)
        return True

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        """The record, or None: never stored, another key's, deleted, evicted or expired."""
        try:
            path = self._path(owner, response_id)
            self._check_folder()
            data = path.read_bytes()
        except (ValueError, OSError):
            return None
        try:
            record = json.loads(data)
        except ValueError:
            return None
        if self.clock() - record.get("stored_at", 0) > self.max_age_s:
            path.unlink(missing_ok=True)
            return None
        return record

    def delete(self, owner: str, response_id: str) -> bool:
        if self.get(owner, response_id) is None:
            return False
        try:
            self._path(owner, response_id).unlink()
            return True
        except OSError:
            return False

    def _evict(self, folder: Path) -> None:
        """Expired records go, then the oldest beyond max_per_key."""
        entries = []
        now = self.clock()
        with os.scandir(folder) as it:
            for entry in it:
                if not entry.name.endswith(".json"):
                    continue
                try:
                    mtime = entry.stat().st_mtime
                except OSError:
                    continue
                if now - mtime > self.max_age_s:
                    Path(entry.path).unlink(missing_ok=True)
                else:
                    entries.append((mtime, entry.path))
        if len(entries) > self.max_per_key:
            entries.sort()
            for _, path in entries[:len(entries) - self.max_per_key]:
                Path(path).unlink(missing_ok=True)
