"""Stored responses (`store: true`): what `previous_response_id` and `GET/DELETE
/v1/responses/{id}` read.

One sqlite database (file mode 600) in a private folder, which every gateway of a tier
(`serve --gateways N`) shares: a follow-up finds its predecessor whichever gateway made it,
and sqlite's locking and journal keep the store whole across processes and crashes. A row
per response, by owner (a digest of the API key: a key reads only its own responses):

- `items`: the input items of this turn, only what is rendered (api/responses_request.py
  `stored_items`); `response`: the response object as JSON, which GET returns as stored;
  `output`: its output items again, what a follow-up reads.
- `parent`: the stored response this one continues. The conversation a response continues
  is its chain of parents, so no row copies its predecessors' items. A predecessor that is
  deleted, evicted or expires while a successor still needs it is hidden (404 to GET, to
  DELETE and as a previous_response_id) and kept until no visible successor does. A
  response whose predecessor vanished while it was generated keeps the history it was
  generated from inline instead (parent NULL).

Bounded per key (the newest `max_per_key` visible responses, `max_bytes_per_key` bytes
with the hidden rows they need) and in all (`max_total_bytes`): past a bound the oldest
visible responses go. A response older than `max_age_s` is gone. The methods do file I/O
and JSON work: callers run them off the event loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from zeroserve.gateway.config import check_private_dir, make_private_dirs

_ID = re.compile(r"^resp_[0-9a-f]{32}$")
PUBLIC_OWNER = "public"  # without API keys every client is the same one
_OWNER = re.compile(r"^([0-9a-f]{32}|public)$")
_OLD_FILE = re.compile(r"^resp_[0-9a-f]{32}(\.json|\.\d+\.tmp)$")
DB_NAME = "stored-responses.sqlite3"
MAX_BYTES_PER_KEY = 64 * 1024 * 1024
MAX_TOTAL_BYTES = 512 * 1024 * 1024
_BUSY_TIMEOUT_S = 10.0  # another gateway of the tier holds the write lock
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    owner TEXT NOT NULL,
    id TEXT NOT NULL,
    parent TEXT,
    stored_at REAL NOT NULL,
    is_visible INTEGER NOT NULL DEFAULT 1,
    items BLOB NOT NULL,
    response BLOB NOT NULL,
    output BLOB NOT NULL,
    num_bytes INTEGER NOT NULL,
    PRIMARY KEY (owner, id)
);
CREATE INDEX IF NOT EXISTS responses_age ON responses (is_visible, stored_at, num_bytes);
"""


def owner_of(api_key: str | None) -> str:
    """An owner name for an API key's responses (a digest: the store never shows a key)."""
    if api_key is None:
        return PUBLIC_OWNER
    return hashlib.sha256(b"zeroserve-responses\0" + api_key.encode()).hexdigest()[:32]


def is_response_id(value: str) -> bool:
    return bool(_ID.match(value))


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


class ResponseStore:
    def __init__(self, folder: str | Path, max_per_key: int = 1000,
                 max_age_s: float = 24 * 3600.0, max_record_bytes: int = 16 * 1024 * 1024,
                 max_bytes_per_key: int = MAX_BYTES_PER_KEY,
                 max_total_bytes: int = MAX_TOTAL_BYTES, clock=time.time):
        self.folder = Path(folder)
        self.max_per_key = max_per_key
        self.max_age_s = max_age_s
        self.max_record_bytes = max_record_bytes
        self.max_bytes_per_key = max_bytes_per_key
        self.max_total_bytes = max_total_bytes
        self.clock = clock
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()  # one connection, used by one thread at a time

    def describe_bounds(self) -> str:
        return (f"stored responses are kept for {self.max_age_s / 3600:g} hours, the newest "
                f"{self.max_per_key} per API key, {self.max_bytes_per_key // 2**20} MiB per "
                "API key")

    # --- the database ------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        """Open the database once: the folder mode 700 (and the parents it makes: the default
        one is under the ipc:// folder, which may not exist yet), refused when others could
        read it or plant rows in it (InsecurePlaneError); the file mode 600."""
        if self._conn is None:
            make_private_dirs(self.folder)
            check_private_dir(self.folder)
            path = self.folder / DB_NAME
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            os.chmod(path, 0o600)  # sqlite gives its journal files the database's mode
            conn = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_S, isolation_level=None,
                                   check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(_SCHEMA)
            self._conn = conn
            _remove_file_store(self.folder)
        return self._conn

    @contextlib.contextmanager
    def _transaction(self, write: bool = False):
        with self._lock:
            conn = self._connect()
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # --- writes --------------------------------------------------------------------------------

    def put(self, owner: str, response: dict[str, Any], items: list[dict[str, Any]],
            previous_id: str | None = None, history: list[dict[str, Any]] | None = None
            ) -> bool:
        """Store a response and this turn's (rendered) input items. `previous_id`: the
        response it continues; `history`: that conversation's items as the response was
        generated from them, kept inline only if the predecessor is gone by now. False when
        it is not kept (larger than a record or a key's bytes may be)."""
        response_id = response["id"]
        if not is_response_id(response_id):
            raise ValueError("not a response id")
        response_bytes = _json(response)
        output_bytes = _json(response["output"])
        with self._transaction(write=True) as conn:
            now = self.clock()
            self._expire(conn, now)
            parent = previous_id if previous_id is not None and conn.execute(
                "SELECT 1 FROM responses WHERE owner = ? AND id = ?",
                (owner, previous_id)).fetchone() else None
            if parent is None and previous_id is not None:
                items = list(history or ()) + items
            items_bytes = _json(items)
            num_bytes = len(items_bytes) + len(response_bytes) + len(output_bytes)
            if num_bytes > min(self.max_record_bytes, self.max_bytes_per_key):
                return False
            conn.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, 1, ?, ?, ?, ?)",
                         (owner, response_id, parent, now, items_bytes, response_bytes,
                          output_bytes, num_bytes))
            self._collect(conn, owner, self.max_per_key, self.max_bytes_per_key)
            (total,) = conn.execute("SELECT total(num_bytes) FROM responses").fetchone()
            if total > self.max_total_bytes:
                self._collect(conn, None, None, self.max_total_bytes)
            return conn.execute("SELECT 1 FROM responses WHERE owner = ? AND id = ? AND "
                                "is_visible", (owner, response_id)).fetchone() is not None

    def delete(self, owner: str, response_id: str) -> bool:
        """Hide a response (gone for its owner; kept only while a successor needs it)."""
        with self._transaction(write=True) as conn:
            changed = conn.execute(
                "UPDATE responses SET is_visible = 0 WHERE owner = ? AND id = ? AND "
                "is_visible AND stored_at >= ?",
                (owner, response_id, self.clock() - self.max_age_s)).rowcount
            if changed:
                self._collect(conn, owner, None, None)
            return bool(changed)

    def _expire(self, conn: sqlite3.Connection, now: float) -> None:
        """Hide what is past max_age_s, and drop what no visible response needs any more."""
        cutoff = now - self.max_age_s
        owners = [o for (o,) in conn.execute(
            "SELECT DISTINCT owner FROM responses WHERE is_visible AND stored_at < ?",
            (cutoff,))]
        if owners:
            conn.execute("UPDATE responses SET is_visible = 0 WHERE is_visible AND "
                         "stored_at < ?", (cutoff,))
            for owner in owners:
                self._collect(conn, owner, None, None)

    def _collect(self, conn: sqlite3.Connection, owner: str | None, max_visible: int | None,
                 max_bytes: int | None) -> None:
        """Within one owner's rows (None: all), hide the oldest visible responses past
        `max_visible` or `max_bytes`, and delete the rows no visible response needs."""
        where, args = ("WHERE owner = ?", (owner,)) if owner is not None else ("", ())
        rows = conn.execute(f"SELECT owner, id, parent, is_visible, stored_at, num_bytes "
                            f"FROM responses {where}", args).fetchall()
        hidden, deleted = plan_eviction(rows, max_visible, max_bytes)
        conn.executemany("UPDATE responses SET is_visible = 0 WHERE owner = ? AND id = ?",
                         hidden)
        conn.executemany("DELETE FROM responses WHERE owner = ? AND id = ?", deleted)

    # --- reads ---------------------------------------------------------------------------------

    def response_json(self, owner: str, response_id: str) -> bytes | None:
        """The response object as stored (JSON), or None: never stored, another key's,
        deleted, evicted or expired."""
        if not is_response_id(response_id):
            return None
        with self._transaction() as conn:
            row = conn.execute(
                "SELECT response FROM responses WHERE owner = ? AND id = ? AND is_visible "
                "AND stored_at >= ?", (owner, response_id, self.clock() - self.max_age_s)
            ).fetchone()
        return None if row is None else bytes(row[0])

    def conversation(self, owner: str, response_id: str) -> list[dict[str, Any]] | None:
        """What a follow-up to this response continues: every input and output item of its
        chain, oldest first; None when the response cannot be read (as response_json)."""
        chain = self._chain(owner, response_id)
        if chain is None:
            return None
        items: list[dict[str, Any]] = []
        for stored_items, output in chain:
            items += json.loads(stored_items)
            items += json.loads(output)
        return items

    def input_items(self, owner: str, response_id: str) -> list[dict[str, Any]] | None:
        """The items a response was generated from (its history and its own input)."""
        chain = self._chain(owner, response_id)
        if chain is None:
            return None
        items: list[dict[str, Any]] = []
        for i, (stored_items, output) in enumerate(chain):
            items += json.loads(stored_items)
            if i < len(chain) - 1:
                items += json.loads(output)
        return items

    def _chain(self, owner: str, response_id: str) -> list[tuple[bytes, bytes]] | None:
        """(items, output) of the response and its predecessors, oldest first (the output
        apart from its response object, which echoes instructions and tools: a long
        conversation would parse them again for every turn)."""
        if not is_response_id(response_id):
            return None
        with self._transaction() as conn:
            rows = conn.execute("""
                WITH RECURSIVE chain(id, depth) AS (
                    SELECT id, 0 FROM responses WHERE owner = :owner AND id = :id
                        AND is_visible AND stored_at >= :cutoff
                    UNION ALL
                    SELECT r.parent, c.depth + 1 FROM chain c JOIN responses r
                        ON r.owner = :owner AND r.id = c.id
                    WHERE r.parent IS NOT NULL AND c.depth < :max_depth)
                SELECT r.items, r.output FROM chain c JOIN responses r
                    ON r.owner = :owner AND r.id = c.id ORDER BY c.depth DESC""",
                {"owner": owner, "id": response_id, "max_depth": 1_000_000,
                 "cutoff": self.clock() - self.max_age_s}).fetchall()
        return [(bytes(items), bytes(output)) for items, output in rows] or None


def _remove_file_store(folder: Path) -> None:
    """The store before this one kept a JSON file per response in a folder per owner
    (`<owner>/resp_<hex>.json`), which nothing reads any more: remove them (only those)."""
    for sub in folder.iterdir():
        if not (sub.is_dir() and not sub.is_symlink() and _OWNER.match(sub.name)):
            continue
        for path in sub.iterdir():
            if _OLD_FILE.match(path.name):
                path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            sub.rmdir()  # (only when empty)


def plan_eviction(rows: Iterable[tuple], max_visible: int | None, max_bytes: int | None
                  ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Rows (owner, id, parent, is_visible, stored_at, num_bytes) -> the (owner, id) keys to
    hide and to delete: the oldest visible past `max_visible`, then past `max_bytes` (the
    bytes of every row kept), are hidden; a row that is neither visible nor a predecessor of
    a visible one is deleted."""
    parent_of: dict[tuple[str, str], tuple[str, str] | None] = {}
    size: dict[tuple[str, str], int] = {}
    visible: list[tuple[float, tuple[str, str]]] = []
    for owner, rid, parent, is_visible, stored_at, num_bytes in rows:
        key = (owner, rid)
        parent_of[key] = None if parent is None else (owner, parent)
        size[key] = num_bytes
        if is_visible:
            visible.append((stored_at, key))
    visible.sort()  # oldest first
    hidden: list[tuple[str, str]] = []
    if max_visible is not None and len(visible) > max_visible:
        hidden = [key for _, key in visible[:len(visible) - max_visible]]
        visible = visible[len(visible) - max_visible:]
    # Kept: the visible rows and their predecessors; children counts among the kept.
    kept: set[tuple[str, str]] = set()
    num_children: dict[tuple[str, str], int] = {}
    for _, key in visible:
        while key is not None and key not in kept and key in parent_of:
            kept.add(key)
            parent = parent_of[key]
            if parent is not None and parent in parent_of:
                num_children[parent] = num_children.get(parent, 0) + 1
            key = parent
    total = sum(size[key] for key in kept)
    is_live = {key for _, key in visible}
    for _, key in visible:
        if max_bytes is None or total <= max_bytes:
            break
        hidden.append(key)
        is_live.discard(key)
        # Drop it, and up its chain every predecessor no other kept row needs.
        while key is not None and key in kept and key not in is_live \
                and not num_children.get(key):
            kept.discard(key)
            total -= size[key]
            key = parent_of[key]
            if key is not None and key in num_children:
                num_children[key] -= 1
    deleted = [key for key in parent_of if key not in kept]
    hidden = [key for key in hidden if key in kept]
    return hidden, deleted
