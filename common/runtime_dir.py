"""The runtime folder, `$TMPDIR/zeroserve-$UID`: where this user's zeroserve processes keep
what only they may read (ipc:// sockets, a tier's shared files, torch traces, the admin token).

Every folder made on the way to a path under it is mode 700 (`make_private_dirs`), and a file
kept there by count or bytes is pruned (`prune_oldest`). Standard library only: the gateway,
the workers and the `zeroserve` commands all use it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def runtime_dir() -> Path:
    """`$TMPDIR/zeroserve-$UID` (not made here: `make_private_dirs` makes it)."""
    return Path(tempfile.gettempdir()) / f"zeroserve-{os.getuid()}"


def make_private_dirs(folder: str | Path) -> Path:
    """`mkdir -p` where every folder made is mode 700; `folder` as a Path.

    Path.mkdir(parents=True, mode=...) and os.makedirs give the parents they make the umask's
    mode (755 under the usual 022): the metrics folder of `serve --gateways N` made the
    ipc:// folder so, as its parent, and the check of that folder then refused it on every
    fresh machine. Folders that exist already are left as they are."""
    folder = Path(folder)
    missing = []
    probe = folder
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for made in reversed(missing):
        try:
            made.mkdir(mode=0o700)
        except FileExistsError:  # another process, just now
            continue
        os.chmod(made, 0o700)  # mkdir's mode passes through the umask too
    return folder


def is_private_dir(folder: str | Path) -> bool:
    """`folder` is this user's own and closed to everyone else (mode 700 or stricter)."""
    info = Path(folder).stat()
    return info.st_uid == os.getuid() and not info.st_mode & 0o077


def prune_oldest(folder: str | Path, suffix: str, max_files: int, max_bytes: int) -> list[Path]:
    """Remove the oldest files of `folder` whose names end in `suffix` until at most
    `max_files` of them remain, together at most `max_bytes` (the newest file stays even
    when it alone is larger). The files removed; files another process removes meanwhile
    are skipped."""
    files = []
    for path in Path(folder).glob(f"*{suffix}"):
        try:
            info = path.stat()
        except OSError:
            continue
        files.append((info.st_mtime_ns, path.name, path, info.st_size))
    files.sort(reverse=True)  # newest first
    kept_bytes, removed = 0, []
    for index, (_, _, path, size) in enumerate(files):
        kept_bytes += size
        if index == 0 or (index < max_files and kept_bytes <= max_bytes):
            continue
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed
