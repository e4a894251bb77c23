"""The ids made per request (gateway/core.py random_hex): random, unique, cheap (the kernel's
bytes read in blocks, not one system call per id) and never shared with a forked child."""

from __future__ import annotations

import os
import re
import threading

from zeroserve.gateway import core
from zeroserve.gateway.core import random_hex


def test_ids_are_unique_hex_from_few_reads_of_the_kernels_random_bytes(monkeypatch):
    reads = []
    urandom = os.urandom

    def counting(n: int) -> bytes:
        reads.append(n)
        return urandom(n)

    monkeypatch.setattr(core.os, "urandom", counting)
    ids = [random_hex() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(reads) <= 5  # was one getrandom() per id


def test_threads_never_get_the_same_id():
    ids: list[str] = []

    def make() -> None:
        ids.extend(random_hex() for _ in range(2000))

    threads = [threading.Thread(target=make) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 8000


def test_a_forked_child_does_not_repeat_its_parents_ids():
    random_hex()  # the parent holds unread random bytes when it forks
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent
        os.write(write_end, random_hex().encode())
        os._exit(0)
    os.close(write_end)
    child_id = os.read(read_end, 64).decode()
    os.close(read_end)
    os.waitpid(pid, 0)
    assert len(child_id) == 32 and child_id != random_hex()
