"""The stored-responses folder: per key, bounded by age and count, atomic, private."""

from __future__ import annotations

import os

import pytest

from zeroserve.common.keys import InsecurePlaneError
from zeroserve.gateway.http.response_store import ResponseStore, owner_of

A, B = owner_of("key-a"), owner_of("key-b")


def rid(n: int) -> str:
    return f"resp_{n:032x}"


def test_put_get_delete_per_key(tmp_path):
    store = ResponseStore(tmp_path / "r")
    assert store.put(A, rid(1), {"response": {"id": rid(1)}, "input": []})
    assert store.get(A, rid(1))["response"] == {"id": rid(1)}
    assert store.get(B, rid(1)) is None  # another key's
    assert not store.delete(B, rid(1)) and store.get(A, rid(1)) is not None
    assert store.delete(A, rid(1)) and store.get(A, rid(1)) is None
    assert "key-a" not in str(list(tmp_path.rglob("*")))  # folders never show a key
    assert owner_of(None) == "public" and A != B


def test_bounds_by_age_and_count(tmp_path):
    now = [1000.0]
    store = ResponseStore(tmp_path, max_per_key=3, max_age_s=60, clock=lambda: now[0])
    for n in range(5):
        store.put(A, rid(n), {"n": n})
        mtime = now[0] - 10 + n  # oldest first
        os.utime(tmp_path / A / f"{rid(n)}.json", (mtime, mtime))
    store.put(B, rid(9), {"n": 9})
    assert [store.get(A, rid(n)) is not None for n in range(5)] == [False, False, True, True,
                                                                   True]
    assert store.get(B, rid(9)) is not None  # bounds are per key
    now[0] += 61
    assert store.get(A, rid(4)) is None and not (tmp_path / A / f"{rid(4)}.json").exists()


def test_too_large_and_bad_ids(tmp_path):
    store = ResponseStore(tmp_path, max_record_bytes=100)
    assert not store.put(A, rid(1), {"x": "y" * 200})
    with pytest.raises(ValueError):
        store.put(A, "../../etc/passwd", {})
    assert store.get(A, "../x") is None and store.get(A, "resp_" + "g" * 32) is None


def test_a_folder_others_can_read_is_refused(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    store = ResponseStore(folder)
    with pytest.raises(InsecurePlaneError):
        store.put(A, rid(1), {})
    assert store.get(A, rid(1)) is None


def test_the_folders_it_makes_are_private_under_a_usual_umask(tmp_path):
    """The default folder is under the ipc:// folder: if the store makes that first, it must
    be mode 700 too, or every gateway started later on the machine refuses it."""
    previous = os.umask(0o022)
    try:
        store = ResponseStore(tmp_path / "ipc" / "gw-8000-responses")
        assert store.put(A, rid(1), {})
    finally:
        os.umask(previous)
    for folder in (tmp_path / "ipc", tmp_path / "ipc" / "gw-8000-responses",
                   tmp_path / "ipc" / "gw-8000-responses" / A):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
