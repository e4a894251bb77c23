"""Gateway logging: the process-wide setup is common.logging_setup (text or JSON lines);
loggers here live under "zeroserve.gateway". Pass context as
`log.info("...", extra={"request_id": rid})` so every line about a request carries its id.
"""

from __future__ import annotations

import logging

from zeroserve.common.logging_setup import JsonFormatter, TextFormatter, setup_logging

__all__ = ["JsonFormatter", "TextFormatter", "get_logger", "setup_logging"]


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"zeroserve.gateway.{name}")
