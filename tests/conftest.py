"""Fixtures for tests that run real zeroserve processes, over zeroserve.cli.harness.

The `zeroserve` fixture hands out servers started by `start_server(...)` (a subprocess on a
free port, ready in /health) and stops them at teardown; `module_servers` shares them among
the tests of one module.
"""

from __future__ import annotations

# First, before anything imports torch: `ZEROSERVE_CPU_CLASS=avx2 ./scripts/test` runs the
# suite as that CPU class, with oneDNN's and ATen's caps set where torch will read them (and
# every server the tests start inherits them).
from zeroserve.worker.cpu_class import apply_to_environment

apply_to_environment()

import os  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two pytest processes share the cores (scripts/test runs `-n 2`): each computes with one
    # OpenMP thread and spins little, or each one's barriers wait on the other's threads
    # (a one-row step took 509 ms beside a busy process with libgomp's default spin, 8.7 ms
    # alone). Set before torch loads; servers the tests start inherit it too.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from zeroserve.cli.harness import ServerProcess, start_server  # noqa: E402


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `cuda` are skipped, with the reason, where torch sees no CUDA GPU.

    torch is imported only when such a test was collected, so the gateway's tests stay light.
    """
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in cuda_items:
        item.add_marker(skip)


@pytest.fixture
def zeroserve(tmp_path) -> Iterator:
    """Factory: zeroserve(args=(...), num_workers=1) -> a ready ServerProcess."""
    servers: list[ServerProcess] = []

    def start(**kwargs) -> ServerProcess:
        server = start_server(tmp_path, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(timeout_s=10)


@pytest.fixture(scope="module")
def module_servers(tmp_path_factory) -> Iterator:
    """Like `zeroserve`, for servers shared by the tests of one module."""
    log_dir = tmp_path_factory.mktemp("servers")
    servers: list[ServerProcess] = []

    def start(**kwargs) -> ServerProcess:
        server = start_server(log_dir, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(timeout_s=10)
