"""A stalled gateway is a pause, a restarted one a clean slate (real processes, fake backend).

The gateway and the worker run as separate processes (`zeroserve gateway` and `zeroserve
worker`), so the test can SIGSTOP or SIGKILL the gateway alone.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.helpers import stream_in_thread
from zeroserve.cli.harness import free_port, start_server

pytestmark = pytest.mark.slow

WORKER_ARGS = ("--backend", "fake", "--device", "cpu", "--fake-forward-ms", "10",
               "--num-kv-blocks", "512", "--worker-id", "w0", "--heartbeat-interval", "0.25",
               "--gateway-timeout", "1.5")


class SplitServer:
    """A worker process and a gateway process on one port; the gateway can be replaced."""

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.port = free_port()
        self.processes = []
        self.gateway = self.start_gateway()
        self.worker = start_server(log_dir, "worker", args=(*WORKER_ARGS, "--port",
                                                            str(self.port)),
                                   port=self.port, wait=False)
        self.processes.append(self.worker)
        self.gateway.wait_ready(1, timeout_s=60)

    def start_gateway(self):
        self.gateway = start_server(self.log_dir, "gateway", args=("--worker-timeout", "2",
                                                                 "--max-tokens-limit", "8192"),
                                    port=self.port, wait=False)
        self.processes.append(self.gateway)
        return self.gateway

    def stop(self) -> None:
        for process in self.processes:
            process.stop(timeout_s=10)


@pytest.fixture
def split(tmp_path):
    server = SplitServer(tmp_path)
    yield server
    server.stop()


def wait_streaming(streams, num_chunks: int = 5) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(len(r.chunks) >= num_chunks
                                                  for _, r in streams):
        time.sleep(0.05)


def test_streams_survive_a_gateway_stopped_past_the_worker_timeout(split):
    gateway = split.gateway
    streams = [stream_in_thread(gateway.url, {"prompt": f"Go on {i}.", "max_tokens": 300,
                                              "stream_options": {"include_usage": True}},
                                timeout_s=60) for i in range(4)]
    wait_streaming(streams)
    os.kill(gateway.process.pid, signal.SIGSTOP)
    time.sleep(4.0)  # longer than the worker's --gateway-timeout (1.5 s) and worker timeout
    os.kill(gateway.process.pid, signal.SIGCONT)
    for thread, _ in streams:
        thread.join(timeout=60)
    for _, result in streams:
        assert result.exception is None and result.error is None and result.is_done
        assert result.finish_reason == "length"
        assert result.usage["completion_tokens"] == 300
    # Nothing left behind: every KV block is free again, the worker is still the same one.
    gateway.wait_for(lambda ws: ws and ws[0]["num_free_blocks"] == ws[0]["num_total_blocks"]
                     and ws[0]["num_in_flight"] == 0, 10, "KV blocks freed")


def test_a_restarted_gateway_makes_the_worker_drop_the_old_streams(split):
    old = split.gateway
    streams = [stream_in_thread(old.url, {"prompt": f"Go on {i}.", "max_tokens": 5000},
                                timeout_s=30) for i in range(3)]
    wait_streaming(streams)
    os.kill(old.process.pid, signal.SIGKILL)
    old.process.wait()
    new = split.start_gateway()
    new.wait_ready(1, timeout_s=60)
    # The worker learns at once that nobody reads the old streams, and frees their KV: told
    # by heartbeats (0.5 s apart) that a loaded machine may send or read late, so 15 s, still
    # far short of the 120 s grace that would hold them without that knowledge.
    new.wait_for(lambda ws: ws and ws[0]["num_free_blocks"] == ws[0]["num_total_blocks"]
                 and ws[0]["num_running"] == 0, 15, "old streams dropped")
    for thread, _ in streams:
        thread.join(timeout=10)
    thread, fresh = stream_in_thread(new.url, {"prompt": "Again.", "max_tokens": 20},
                                     timeout_s=30)
    thread.join(timeout=30)
    assert fresh.error is None and fresh.finish_reason == "length"
