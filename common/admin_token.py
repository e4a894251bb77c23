"""The admin token: a secret that only the user who runs the gateway can read, so that the
`zeroserve` commands of that user operate it without an admin key (as Jupyter's token file,
or Docker's socket, closed to other users by its mode).

The file is `$TMPDIR/zeroserve-$UID/admin-token` (common/runtime_dir.py): mode 600 in a
folder of mode 700, one token for every gateway this user runs on this machine. A gateway
makes it when it starts (or reads the one there); `zeroserve workers|models|debug` read it
and send it, as `X-Zeroserve-Admin-Token`, to a gateway they reach by a loopback address.
Another user, a container on the host network or a web page cannot read it; what it grants
is the gateway's rule (gateway/http/admin.py).
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

from zeroserve.common.runtime_dir import make_private_dirs, runtime_dir

TOKEN_HEADER = "X-Zeroserve-Admin-Token"
_TOKEN_BYTES = 32
_MAX_FILE_BYTES = 256


def token_path() -> Path:
    return runtime_dir() / "admin-token"


def read_token(path: Path | None = None) -> str | None:
    """The token in the file, when the file is this user's own and closed to others; None
    when there is none (or it cannot be trusted, or read)."""
    path = token_path() if path is None else path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid()
                or info.st_mode & 0o077):
            return None
        token = f.read(_MAX_FILE_BYTES).decode("ascii", "replace").strip()
    return token if _is_well_formed(token) else None


def load_or_create_token(path: Path | None = None) -> str:
    """The token in the file, made first when there is none (by whichever process comes
    first: the others read that one). OSError if the folder is not this user's own and
    closed to others, or the file cannot be made."""
    path = token_path() if path is None else path
    make_private_dirs(path.parent)
    info = path.parent.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise OSError(f"{path.parent} must be owned by uid {os.getuid()} and closed to others "
                      f"(mode 700) to hold the admin token; it is uid {info.st_uid}, mode "
                      f"{oct(info.st_mode & 0o777)}")
    token = read_token(path)
    if token is not None:
        return token
    token = secrets.token_urlsafe(_TOKEN_BYTES)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".admin-token-")  # mode 600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        try:
            os.link(tmp, path)  # only where there is none: a racing gateway's stays
        except FileExistsError:
            found = read_token(path)
            if found is not None:
                return found
            os.replace(tmp, path)  # one we cannot use (another mode, garbage): ours
    finally:
        Path(tmp).unlink(missing_ok=True)
    return token


def _is_well_formed(token: str) -> bool:
    return 32 <= len(token) <= 128 and token.isascii() and token.isprintable() \
        and " " not in token
