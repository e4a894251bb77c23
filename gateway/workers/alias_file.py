"""Alias weights shared by the gateways of a tier: one small JSON file they all watch.

`zeroserve serve --gateways N` runs N gateway processes behind one port; an operator's
`zeroserve models set-weights` reaches one of them (whichever the kernel hands the
connection). That one changes the file and the others notice its change within
`check_interval_s` on their next aliased request, the way they already share stored
responses and metrics snapshots through the tier's folder.

A change is read-modify-write under an exclusive `flock` on a lock file beside it
(`aliases.json.lock`): re-read the file, set the one alias, write a temporary file and
rename it over the file. So two gateways that change aliases one after the other (or at
once) both keep their change: neither writes the file from what it held in memory.
Gateways on different machines share nothing: give them a shared folder
(`--aliases-file`), or let `set-weights` address each (`--url` repeated).

The file: `{"aliases": {"chat": {"smollm@v1": 90, "smollm@v2": 10}}}`. A file that cannot be
read or parsed changes nothing (the weights in effect stay).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from zeroserve.common.runtime_dir import make_private_dirs

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
        return _aliases_of(self.path)

    def update(self, name: str, weights: dict[str, float]) -> dict[str, dict]:
        """Set one alias's weights in the file, every other alias staying as the file has it
        now; the file's aliases after the change. OSError if it cannot be written."""
        make_private_dirs(self.path.parent)
        with self._locked():
            try:
                aliases = _aliases_of(self.path, strict=True) or {}
            except FileNotFoundError:
                aliases = {}
            aliases[name] = weights
            self._write(aliases)
        return aliases

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The tier's exclusive lock on the file (held a read and a write: milliseconds)."""
        fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _write(self, aliases: dict[str, dict]) -> None:
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


def _aliases_of(path: Path, strict: bool = False) -> dict[str, dict] | None:
    """The file's aliases (those with a name and an object of weights); None if it cannot
    be read or parsed. `strict`: OSError instead (FileNotFoundError when there is none), so
    that a change never replaces a file it could not read with its own alias alone."""
    try:
        with path.open("rb") as f:
            raw = f.read(_MAX_BYTES + 1)
        if len(raw) > _MAX_BYTES:
            raise OSError(f"{path} is larger than {_MAX_BYTES} bytes")
        aliases = json.loads(raw)["aliases"]
        if not isinstance(aliases, dict):
            raise ValueError("'aliases' is not an object")
    except FileNotFoundError:
        if strict:
            raise
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        if strict:
            raise OSError(f"{path} cannot be read as an aliases file ({e})") from None
        return None
    return {k: v for k, v in aliases.items() if isinstance(k, str) and isinstance(v, dict)}
