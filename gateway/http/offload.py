"""A few threads for CPU-heavy request work (big JSON bodies, chat templates, tokenizing,
large decodes), so one request never holds the event loop that every stream shares.

What helps is measured, not assumed: `tokenizers`' `encode_batch`/`decode_batch` release the
GIL (plain `encode`/`decode` do not), pure-Python work (jinja2) yields the GIL every switch
interval (5 ms), and C code that holds the GIL (json.loads) gains nothing from a thread, so
request_body.py bounds it instead. The pool is bounded: extra work waits in its queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_NUM_THREADS = 2


class CpuPool:
    def __init__(self, num_threads: int = DEFAULT_NUM_THREADS):
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="gateway-cpu")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
