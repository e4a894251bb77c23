"""Class shares set at run time (the admin API), kept across a gateway restart (issue 39).

`POST /admin/classes/{name}/share` changes a class's share in the running gateway and records
it here: `{"shares": {"sheddable": {"share": 0.5, "file_share": 1.0}}}`, `file_share` being
the share the limits file gave that class when the operator set it. A gateway starting
applies each recorded share whose class still has that `file_share` in the limits file, and
forgets the others: so an edit of a class's share in the limits file wins over an earlier
admin change (the operator changed the source of truth since), while an edit of anything
else in the file (a key's rate, another class) keeps it.

The file lives in the runtime folder, one per port (GatewayConfig.class_shares_file,
`tier_class_shares_file`), so the gateways of `serve --gateways N` share it and a restarted
gateway finds it. Writes are a temporary file renamed over the file, under an exclusive
`flock` on a lock file beside it (two gateways setting shares at once both keep theirs). A
file that cannot be read or parsed changes nothing; one that cannot be written leaves the
share set in this gateway only (the admin API says so).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from zeroserve.common.runtime_dir import make_private_dirs
from zeroserve.gateway.logging import get_logger
from zeroserve.gateway.priority_classes import PriorityClasses, PriorityConfigError, check_share

log = get_logger("class_shares")

_MAX_BYTES = 64 * 1024


class ClassShares:
    def __init__(self, path: str | Path | None, classes: PriorityClasses):
        self.path = None if path is None else Path(path)
        self.classes = classes  # as the limits file has them (their file shares)

    def restore(self) -> dict[str, float]:
        """The recorded shares that still hold (their class's share in the limits file is
        the one it had when they were set); the others are dropped from the file."""
        if self.path is None:
            return {}
        with self._locked():
            recorded = self._read()
            kept = {name: entry for name, entry in recorded.items()
                    if self._file_share(name) == entry["file_share"]}
            if kept != recorded:
                with contextlib.suppress(OSError):
                    self._write(kept)
        dropped = sorted(set(recorded) - set(kept))
        if dropped:
            log.info("class shares from the admin API dropped: the limits file changed them",
                     extra={"priority_classes": dropped})
        return {name: entry["share"] for name, entry in kept.items()}

    def record(self, name: str, share: float) -> bool:
        """Keep `name`'s share for the next start; False if the file cannot be written."""
        if self.path is None:
            return False
        file_share = self._file_share(name)
        try:
            make_private_dirs(self.path.parent)
            with self._locked():
                recorded = self._read()
                recorded[name] = {"share": share, "file_share": file_share}
                self._write(recorded)
        except OSError as e:
            log.warning("could not keep a class's share", extra={"error": str(e)})
            return False
        return True

    def _file_share(self, name: str) -> float | None:
        rank = self.classes.rank_of(name)
        return None if rank is None else self.classes.classes[rank].share

    def _read(self) -> dict[str, dict]:
        try:
            if self.path.stat().st_size > _MAX_BYTES:
                return {}
            table = json.loads(self.path.read_text())
            entries = table["shares"]
            return {name: {"share": check_share(e["share"], name),
                           "file_share": float(e["file_share"])}
                    for name, e in entries.items() if self.classes.rank_of(name) is not None}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError,
                PriorityConfigError) as e:
            log.warning("class shares file unreadable; ignored",
                        extra={"path": str(self.path), "error": str(e)})
            return {}

    def _write(self, recorded: dict[str, dict]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".class-shares-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"shares": recorded}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            yield  # (no folder yet: nothing recorded to read or rewrite)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
