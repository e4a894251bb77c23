"""Garbage-collector settings for the long-running server processes (gateway, worker).

Both relay thousands of small containers a second (msgpack arrays, per-stream outputs), most
of which die young. CPython's defaults (a young collection every 700 net allocations, older
ones every 10) then run young collections hundreds of times a second, promote whatever is
alive at that instant (every in-flight output), and run full collections that walk the whole
heap: measured with 1,000 streams, a worker spent ~80 ms in each of its full collections
(8 in 9 s) and both processes' streams stalled behind them. So:

- `gc.freeze()` once start-up is done: what exists by then (modules, the model's Python
  side, the app) lives for the whole process and is never scanned again;
- a young generation of 50,000 objects, so young collections are rare and the short-lived
  containers of one step are gone before one runs. Reference cycles are still collected.
"""

from __future__ import annotations

import gc

THRESHOLDS = (50_000, 20, 20)


def tune_for_serving() -> None:
    """Call once a server process has finished starting (and before it serves)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
