"""Process-wide logging: readable text for a terminal, one JSON object a line in production.

Call sites attach context through `extra`, e.g.
`log.info("request finished", extra={"request_id": rid, "worker_id": wid})`; the JSON
formatter copies every such field into the object, so logs can be joined by request id.
"""

from __future__ import annotations

import json
import logging
import sys
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


def setup_logging(log_format: str = "text", level: str | int = "INFO") -> None:
    """Replace the root handlers with one stderr handler in the given format."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, not {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
