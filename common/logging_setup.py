"""Process-wide logging: readable text for a terminal, one JSON object a line in production.

Call sites attach context through `extra`, e.g.
`log.info("request finished", extra={"request_id": rid, "worker_id": wid})`; the JSON
formatter copies every such field into the object, so logs can be joined by request id.
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time

LOG_FORMATS = ("text", "json")

# Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName",
}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def printable(value: object, limit: int = 200) -> str:
    """A value from a peer or a client, safe to put in a log line: one line, no control
    characters (they are escaped), at most `limit` characters."""
    text = str(value)
    if len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable():
        return text
    return ascii(text)[1:-1]


class RateLimited:
    """Let a repeated warning through at most once per `interval_s` per key, saying how many
    were held back meanwhile, so a hostile peer cannot flood the log."""

    def __init__(self, interval_s: float = 10.0, max_keys: int = 1024):
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._last: dict[str, tuple[float, int]] = {}  # key -> (last logged, suppressed)

    def allow(self, key: str) -> int | None:
        """None: hold this one back; else the number held back since the last one."""
        now = time.monotonic()
        last, num_held = self._last.get(key, (-1e18, 0))
        if now - last < self.interval_s:
            self._last[key] = (last, num_held + 1)
            return None
        if len(self._last) >= self.max_keys:
            self._last.clear()
        self._last[key] = (now, 0)
        return num_held


class TextFormatter(logging.Formatter):
    """`time level logger: message key=value ...` with the `extra` fields appended (escaped:
    they may come from peers)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = [
            f"{key}={printable(value)}" for key, value in vars(record).items()
            if key not in _STANDARD_ATTRS and not key.startswith("_")
        ]
        if context:
            # Keep a traceback (which super() appended) at the end.
            head, sep, tail = line.partition("\n")
            line = f"{head} {' '.join(context)}{sep}{tail}"
        return line


class BackgroundHandler(logging.Handler):
    """Hands records to a thread that formats and writes them, and never blocks the caller.

    A log's reader may stall: a pipe nobody drains (`serve | less`), a paused terminal, a
    log collector applying backpressure. A plain StreamHandler then blocks in write() on the
    thread that logged, which in the gateway is the event loop: every stream on it stopped
    once 64 KiB of request lines filled a stderr pipe. Here the caller only queues the
    record; while more than `max_records` wait, records are dropped and counted, and the
    writer says how many once its reader takes lines again.

    The queue is a SimpleQueue, whose put is safe even from a signal handler or a
    finalizer (no lock that the interrupted code could be holding).
    """

    def __init__(self, target: logging.Handler, max_records: int = 10_000):
        super().__init__()
        self.target = target
        self.max_records = max_records
        self.num_dropped = 0  # written by emit() only (under the handler's lock)
        self._num_reported = 0  # written by the writer thread only
        self._queue: queue.SimpleQueue[logging.LogRecord | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write_loop, daemon=True, name="log-writer")
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        if self._queue.qsize() >= self.max_records:
            self.num_dropped += 1
            return
        try:
            # Merge the arguments now: they may change once the caller goes on.
            record.msg = record.getMessage()
            record.args = None
        except Exception:
            self.handleError(record)
            return
        self._queue.put(record)

    def _write_loop(self) -> None:
        while (record := self._queue.get()) is not None:
            num_dropped = self.num_dropped - self._num_reported
            if num_dropped:
                self._num_reported += num_dropped
                self.target.handle(logging.makeLogRecord({
                    "name": "zeroserve.logging", "levelno": logging.WARNING,
                    "levelname": "WARNING", "num_dropped": num_dropped,
                    "msg": f"{num_dropped} log records dropped: the log's reader was not "
                           "keeping up"}))
            self.target.handle(record)

    def close(self, timeout_s: float = 2.0) -> None:
        """Write what is queued, waiting at most `timeout_s` for a stalled reader."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        self.target.close()
        super().close()


def setup_logging(log_format: str = "text", level: str | int = "INFO") -> None:
    """Replace the root handlers with one stderr handler in the given format, written from
    a thread of its own (BackgroundHandler): a stalled reader never blocks a caller."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, not {log_format!r}")
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        if isinstance(old, BackgroundHandler):  # ours, from an earlier call: end its thread
            old.close()
    root.addHandler(BackgroundHandler(stream))
    root.setLevel(level.upper() if isinstance(level, str) else level)
