"""Fixtures shared by the end-to-end test modules.

`real_model_server`: one `zeroserve serve` of the real default model for the whole session,
shared by every module that needs the real model behind the HTTP API but not a configuration
of its own (the OpenAI client tests, structured output, the console's JSON-schema reply).
Starting it costs a GGUF load and a worker start (and its stop some seconds more) per module
otherwise. Tests that share it must not assume a fresh server: counters they check are read
before and after (see test_structured_output_real_model's prefix-cache test).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.session_cache import session_cache_dir
from zeroserve.cli.harness import ServerProcess, start_server

HERE = Path(__file__).parent
# One torch thread: on two cores the worker's second OpenMP thread waits at every barrier
# for a core that the gateway, the test's client or anything else on the machine holds.
# With one other busy process on a 2-core machine, two JSON-schema replies and a 40-token
# stream took 55 s with 2 threads and 7 s with 1 (scripts: see the commit that set this).
NUM_THREADS = 1
# float32: deterministic on the CPU, and what the in-process reference engines load.
REAL_MODEL_FLAGS = ("--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256",
                    "--max-num-seqs", "4", "--num-threads", str(NUM_THREADS))


_REAL_MODEL_SERVER = pytest.StashKey[ServerProcess]()


@pytest.fixture(scope="session")
def real_model_server(request, tmp_path_factory) -> Iterator[ServerProcess]:
    # Its prepared weights go to the session's cache folder, where tests/worker's engines of
    # the same model and dtype find them (tests/session_cache.py).
    server = start_server(tmp_path_factory.mktemp("real-model-server"), args=REAL_MODEL_FLAGS,
                          timeout_s=240,
                          env={"ZEROSERVE_CACHE_DIR": str(session_cache_dir(tmp_path_factory))})
    request.config.stash[_REAL_MODEL_SERVER] = server
    yield server
    if server.process.poll() is None:  # not stopped on leaving tests/e2e (below)
        server.stop(timeout_s=10)


def pytest_runtest_teardown(item, nextitem) -> None:
    """Stop the shared server once the run leaves tests/e2e: the session's other tests need
    no real model idling beside them (its memory, its heartbeats). Not under pytest-xdist
    (scripts/test's `-n 2`): there a process gets modules in no set order, e2e ones after
    others, and the session fixture would hand them the stopped server; it stops at the end."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    server = item.config.stash.get(_REAL_MODEL_SERVER, None)
    if server is None or (nextitem is not None and Path(nextitem.path).is_relative_to(HERE)):
        return
    del item.config.stash[_REAL_MODEL_SERVER]
    server.stop(timeout_s=10)
