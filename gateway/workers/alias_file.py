"""Alias weights shared by the gateways of a tier: one small JSON file they all watch.

`zeroserve serve --gateways N` runs N gateway processes behind one port; an operator's
`zeroserve models set-weights` reaches one of them (whichever the kernel hands the
connection). That one writes the file (atomically: a temporary file renamed over it) and
the others notice its change within `check_interval_s` on their next aliased request, the
way they already share stored responses and metrics snapshots through the tier's folder.
Gateways on different machines share nothing: give them a shared folder
(`--aliases-file`), or let `set-weights` address each (`--url` repeated).

The file: `{"aliases": {"chat": {"smollm@v1": 90, "smollm@v2": 10}}}`. A file that cannot be
read or parsed changes nothing (the weights in effect stay).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

_MAX_BYTES = 256 * 1024


class AliasFile:
    def __init__(self, path: str | Path, check_interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self.check_interval_s = check_interval_s
        self.clock = clock
        self._checked_at = -1e18
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) last read

    def read_if_changed(self, force: bool = False) -> dict[str, dict] | None:
        """The aliases' weights when the file changed since the last look, else None."""
        now = self.clock()
        if not force and now - self._checked_at < self.check_interval_s:
            return None
        self._checked_at = now
        try:
            info = self.path.stat()
        except OSError:
            return None
        stamp = (info.st_mtime_ns, info.st_size)
        if stamp == self._seen or info.st_size > _MAX_BYTES:
            return None
        self._seen = stamp
        try:
            aliases = json.loads(self.path.read_text())["aliases"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not isinstance(aliases, dict):
            return None
        return {k: v for k, v in aliases.items() if isinstance(k, str) and isinstance(v, dict)}

    def write(self, aliases: dict[str, dict]) -> None:
        """Replace the file's content (every alias, with its weights). OSError if it cannot."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".aliases-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"aliases": aliases}, f)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        info = self.path.stat()
        self._seen = (info.st_mtime_ns, info.st_size)  # ours: nothing to read back
