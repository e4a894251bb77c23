"""The stored responses: per key, bounded by age, count and bytes, private, conversations by
links (never copies), and a conversation that keeps its history whatever happens to its
predecessors."""

from __future__ import annotations

import os
import sqlite3

import pytest

from zeroserve.common.keys import InsecurePlaneError
from zeroserve.gateway.http.response_store import DB_NAME, ResponseStore, owner_of

A, B = owner_of("key-a"), owner_of("key-b")


def rid(n: int) -> str:
    return f"resp_{n:032x}"


def response(n: int, text: str = "out") -> dict:
    return {"id": rid(n), "object": "response",
            "output": [{"type": "message", "role": "assistant", "content": text}]}


def said(text: str) -> list[dict]:
    return [{"type": "message", "role": "user", "content": text}]


def texts(items: list[dict] | None) -> list[str]:
    assert items is not None
    return [item["content"] for item in items]


def stored_bytes(store: ResponseStore) -> int:
    db = sqlite3.connect(store.folder / DB_NAME)
    try:
        return db.execute("SELECT total(num_bytes) FROM responses").fetchone()[0]
    finally:
        db.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 0.001  # every put a little later than the last
        return self.now


def test_put_read_delete_per_key(tmp_path):
    store = ResponseStore(tmp_path / "r")
    assert store.put(A, response(1), said("hi"))
    assert store.response_json(A, rid(1)).startswith(b'{"id":"' + rid(1).encode())
    assert texts(store.input_items(A, rid(1))) == ["hi"]
    assert texts(store.conversation(A, rid(1))) == ["hi", "out"]
    assert store.response_json(B, rid(1)) is None  # another key's
    assert not store.delete(B, rid(1)) and store.response_json(A, rid(1)) is not None
    assert store.delete(A, rid(1)) and store.response_json(A, rid(1)) is None
    assert not store.delete(A, rid(1))
    assert stored_bytes(store) == 0  # nothing needs it: gone, not hidden
    assert "key-a" not in str(list(tmp_path.rglob("*")))
    assert owner_of(None) == "public" and A != B


def test_bounds_by_age_and_count(tmp_path):
    clock = Clock()
    store = ResponseStore(tmp_path, max_per_key=3, max_age_s=60, clock=clock)
    for n in range(5):
        store.put(A, response(n), said(f"{n}"))
    store.put(B, response(9), said("9"))
    assert [store.response_json(A, rid(n)) is not None for n in range(5)] == [
        False, False, True, True, True]
    assert store.response_json(B, rid(9)) is not None  # bounds are per key
    clock.now += 61
    assert store.response_json(A, rid(4)) is None and store.conversation(A, rid(4)) is None
    store.put(B, response(10), said("10"))  # a write drops every key's expired rows
    assert stored_bytes(store) == store_bytes_of(store, B, 10)


def store_bytes_of(store: ResponseStore, owner: str, n: int) -> int:
    db = sqlite3.connect(store.folder / DB_NAME)
    try:
        return db.execute("SELECT num_bytes FROM responses WHERE owner = ? AND id = ?",
                          (owner, rid(n))).fetchone()[0]
    finally:
        db.close()


def test_too_large_and_bad_ids(tmp_path):
    store = ResponseStore(tmp_path, max_record_bytes=200)
    assert not store.put(A, response(1), said("y" * 300))
    assert store.response_json(A, rid(1)) is None
    with pytest.raises(ValueError):
        store.put(A, {"id": "../../etc/passwd"}, [])
    assert store.response_json(A, "../x") is None
    assert store.response_json(A, "resp_" + "g" * 32) is None
    assert store.conversation(A, "nope") is None and not store.delete(A, "nope")


def test_a_folder_others_can_read_is_refused(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    store = ResponseStore(folder)
    with pytest.raises(InsecurePlaneError):
        store.put(A, response(1), [])
    with pytest.raises(InsecurePlaneError):
        store.response_json(A, rid(1))


def test_the_folders_and_files_it_makes_are_private_under_a_usual_umask(tmp_path):
    """The default folder is under the ipc:// folder: if the store makes that first, it must
    be mode 700 too, or every gateway started later on the machine refuses it; the database
    and its journal files are 600 (issue 35, item 6: they were 644)."""
    previous = os.umask(0o022)
    try:
        store = ResponseStore(tmp_path / "ipc" / "gw-8000-responses")
        assert store.put(A, response(1), said("hi"))
    finally:
        os.umask(previous)
    for folder in (tmp_path / "ipc", tmp_path / "ipc" / "gw-8000-responses"):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    files = list((tmp_path / "ipc" / "gw-8000-responses").iterdir())
    assert files and all(f.stat().st_mode & 0o777 == 0o600 for f in files), files


def test_a_conversation_is_stored_once_not_copied_into_every_turn(tmp_path):
    """Each turn stores its own items and links to its predecessor: 40 turns of 1 kB take
    about 40 kB, not the 40 x 41 / 2 kB that copying the history into every record took."""
    store = ResponseStore(tmp_path)
    previous = None
    for n in range(40):
        history = None if previous is None else store.conversation(A, previous)
        assert store.put(A, response(n, f"answer {n}"), said(f"{n}:" + "x" * 1000),
                         previous, history)
        previous = rid(n)
    conversation = texts(store.conversation(A, rid(39)))
    assert len(conversation) == 80 and conversation[-1] == "answer 39"
    assert conversation[:2] == ["0:" + "x" * 1000, "answer 0"]
    assert len(texts(store.input_items(A, rid(39)))) == 79  # all but its own output
    assert stored_bytes(store) < 40 * 1300


def test_bytes_are_bounded_per_key_and_in_all(tmp_path):
    store = ResponseStore(tmp_path, max_bytes_per_key=10_000, max_total_bytes=16_000,
                          clock=Clock())
    for n in range(10):
        assert store.put(A, response(n), said("a" * 2000))
    kept = [n for n in range(10) if store.response_json(A, rid(n)) is not None]
    assert kept == list(range(10 - len(kept), 10)) and 3 <= len(kept) <= 4
    assert stored_bytes(store) <= 10_000
    for n in range(100, 110):
        assert store.put(B, response(n), said("b" * 2000))
    assert stored_bytes(store) <= 16_000  # the oldest go, whichever key's
    assert store.response_json(B, rid(109)) is not None
    assert not store.put(A, response(50), said("c" * 20_000))  # more than a key may keep


def test_a_response_keeps_its_history_when_its_predecessor_goes_while_it_generates(tmp_path):
    """Issue 35, item 14: the next turn read the conversation at its start; its predecessor
    is deleted (or evicted, or expires) before it is stored: it keeps what it came from."""
    store = ResponseStore(tmp_path)
    store.put(A, response(1, "first answer"), said("first"))
    history = store.conversation(A, rid(1))  # at the next turn's start
    assert store.delete(A, rid(1))
    assert store.put(A, response(2, "second answer"), said("second"), rid(1), history)
    assert texts(store.conversation(A, rid(2))) == ["first", "first answer", "second",
                                                    "second answer"]
    assert store.response_json(A, rid(1)) is None


def test_a_deleted_or_expired_predecessor_is_hidden_while_a_successor_needs_it(tmp_path):
    clock = Clock()
    store = ResponseStore(tmp_path, max_age_s=60, clock=clock)
    store.put(A, response(1, "a1"), said("q1"))
    store.put(A, response(2, "a2"), said("q2"), rid(1), store.conversation(A, rid(1)))
    store.put(A, response(3, "a3"), said("q3"), rid(2), store.conversation(A, rid(2)))
    assert store.delete(A, rid(2))
    assert store.response_json(A, rid(2)) is None and store.conversation(A, rid(2)) is None
    assert texts(store.conversation(A, rid(3))) == ["q1", "a1", "q2", "a2", "q3", "a3"]
    clock.now += 30
    store.put(A, response(4, "a4"), said("q4"), rid(3), store.conversation(A, rid(3)))
    clock.now += 31  # 1, 2 and 3 are past their age; 4 is not and needs them all
    store.put(B, response(9), said("other key"))
    assert store.response_json(A, rid(3)) is None
    assert texts(store.conversation(A, rid(4)))[::2] == ["q1", "q2", "q3", "q4"]
    assert store.delete(A, rid(4))
    assert stored_bytes(store) == store_bytes_of(store, B, 9)  # nothing of A's is left


def test_eviction_never_leaves_a_conversation_without_its_start(tmp_path):
    store = ResponseStore(tmp_path, max_per_key=3, clock=Clock())
    previous = None
    for n in range(8):
        history = None if previous is None else store.conversation(A, previous)
        store.put(A, response(n, f"a{n}"), said(f"q{n}"), previous, history)
        previous = rid(n)
    assert [store.response_json(A, rid(n)) is not None for n in range(8)] == [False] * 5 + [
        True] * 3
    assert texts(store.conversation(A, rid(5)))[::2] == [f"q{n}" for n in range(6)]


def test_the_files_of_the_store_before_are_removed(tmp_path):
    """Responses were a JSON file each in a folder per key; nothing reads those now."""
    old = tmp_path / A
    old.mkdir(mode=0o700)
    (old / f"{rid(1)}.json").write_text("{}")
    (tmp_path / "public").mkdir(mode=0o700)
    (tmp_path / "public" / f"{rid(2)}.123.tmp").write_text("{")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / f"{rid(3)}.json").write_text("{}")
    ResponseStore(tmp_path).put(A, response(4), said("hi"))
    assert not old.exists() and not (tmp_path / "public").exists()
    assert (tmp_path / "notes" / f"{rid(3)}.json").exists()  # not an owner's folder
