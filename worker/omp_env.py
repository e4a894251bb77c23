"""How long torch's OpenMP threads spin before they sleep, set before torch is imported.

torch's CPU threads (libgomp) wait for each other at the end of every parallel region, and
by default a waiting thread spins for a long time (GOMP_SPINCOUNT 300,000) before it sleeps.
On cores of its own that costs nothing. Where another busy process shares the cores, above
all a second worker on the same machine (`serve --workers 2` or `--add-model` on the CPU,
each sized to every core), the spinning threads take the time slices the threads they wait
for need: measured on 2 cores with two workers' decode steps at once, a one-row step went
from 8.7 ms alone to 509 ms with the default, against 35 ms with a spin count of 10,000
(docs/benchmarks.md, session 13). Alone, 10,000 measured the same as the default (a decode
step's parallel regions follow each other within the spin).

A worker therefore sets GOMP_SPINCOUNT to 10,000 unless the operator set GOMP_SPINCOUNT or
OMP_WAIT_POLICY (theirs win). libgomp reads them once, when torch loads it: this must run
before the worker's first `import torch`, and does nothing where torch is already loaded
(a worker inside a test process).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Container, MutableMapping

SPIN_COUNT = 10_000


def bound_omp_spinning(environ: MutableMapping[str, str] | None = None,
                       modules: Container[str] | None = None) -> bool:
    """Set GOMP_SPINCOUNT in `environ` (this process's) where nothing set it and torch is not
    among `modules` (this process's) yet; whether it was set."""
    env = os.environ if environ is None else environ
    loaded = sys.modules if modules is None else modules
    if "torch" in loaded or "GOMP_SPINCOUNT" in env or "OMP_WAIT_POLICY" in env:
        return False
    env["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return True
