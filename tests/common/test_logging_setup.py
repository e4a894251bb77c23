"""Logging never blocks the code that logs, even when nobody reads the log."""

from __future__ import annotations

import logging
import os
import threading

from zeroserve.common.logging_setup import BackgroundHandler, TextFormatter


def _pipe_handler(max_records: int) -> tuple[BackgroundHandler, int]:
    """A handler writing into a pipe that nobody reads yet (64 KiB fill it)."""
    read_fd, write_fd = os.pipe()
    stream = logging.StreamHandler(os.fdopen(write_fd, "w"))
    stream.setFormatter(TextFormatter())
    return BackgroundHandler(stream, max_records=max_records), read_fd


def _read_all(fd: int) -> str:
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return b"".join(chunks).decode()
        if not chunk:
            return b"".join(chunks).decode()
        chunks.append(chunk)


def test_a_stalled_reader_does_not_block_the_caller():
    handler, read_fd = _pipe_handler(max_records=1000)
    log = logging.Logger("stalled")
    log.addHandler(handler)

    def log_a_lot():  # ~1 MB of lines: a plain StreamHandler blocks after 64 KiB
        for i in range(10_000):
            log.info("request done", extra={"request_id": f"req-{i}", "padding": "x" * 60})

    caller = threading.Thread(target=log_a_lot, daemon=True)
    caller.start()
    caller.join(timeout=20)
    assert not caller.is_alive(), "logging blocked on a pipe nobody reads"
    assert handler.num_dropped > 0  # the queue stayed bounded

    # The reader comes back: what was queued is written, and the drop is told.
    text = ""
    for _ in range(200):
        text += _read_all(read_fd)
        if "log records dropped" in text:
            break
        threading.Event().wait(0.05)
    assert "request_id=req-0 " in text
    assert "log records dropped" in text
    closer = threading.Thread(target=handler.close, daemon=True)
    closer.start()
    while closer.is_alive():
        _read_all(read_fd)
        closer.join(timeout=0.05)
    os.close(read_fd)


def test_records_keep_their_arguments_as_they_were_when_logged():
    handler, read_fd = _pipe_handler(max_records=100)
    log = logging.Logger("args")
    log.addHandler(handler)
    value = ["before"]
    log.warning("value %s", value)
    value[0] = "after"  # the caller goes on and changes it before the writer runs
    handler.close()
    text = _read_all(read_fd)
    os.close(read_fd)
    assert "value ['before']" in text and "after" not in text


def test_close_does_not_hang_on_a_stalled_reader():
    handler, read_fd = _pipe_handler(max_records=10_000)
    log = logging.Logger("close")
    log.addHandler(handler)
    for i in range(5_000):
        log.info("line %d %s", i, "y" * 80)
    closer = threading.Thread(target=handler.close, kwargs={"timeout_s": 0.5}, daemon=True)
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive()
    # Let the writer finish what it still holds (it would write into a closed pipe).
    for _ in range(400):
        _read_all(read_fd)
        if not handler._thread.is_alive():
            break
        threading.Event().wait(0.05)
    os.close(read_fd)
