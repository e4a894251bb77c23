"""`zeroserve serve`: a worker SIGKILLed under the supervisor is taken out by the gateway the
moment the supervisor reaps it (issue 37), so its stream fails over long before the
heartbeats could lapse (here a 60 s --worker-timeout) and before the killed worker's own
restart says HELLO."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.helpers import stream_in_thread

pytestmark = pytest.mark.slow

SILENCE_TIMEOUT_S = 60.0  # --worker-timeout: far beyond every wait below
WAIT_S = 45.0


def test_a_sigkilled_workers_stream_fails_over_on_its_exit(zeroserve):
    server = zeroserve(args=("--backend", "fake", "--device", "cpu", "--workers", "2",
                             "--fake-forward-ms", "5", "--worker-timeout",
                             str(SILENCE_TIMEOUT_S)), num_workers=2)
    body = {"prompt": "Go on.", "max_tokens": 400}
    thread, undisturbed = stream_in_thread(server.url, body)
    thread.join(WAIT_S)
    assert undisturbed.finish_reason == "length", undisturbed.error
    thread, result = stream_in_thread(server.url, body)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and len(result.chunks) < 20:
        time.sleep(0.02)
    victim = next(w for w in server.workers() if w["num_in_flight"])
    killed_at = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    thread.join(WAIT_S)

    # The stream went on, whole and undisturbed, within the heartbeat timeout.
    assert result.exception is None and result.error is None, result.error
    assert result.text == undisturbed.text
    assert result.ended_at - killed_at < SILENCE_TIMEOUT_S
    # Because the gateway was told of the exit, before the restarted process said HELLO.
    log = server.log_tail(400)
    told = log.find("worker lost: it exited (killed by SIGKILL)")
    assert told >= 0, log
    assert "no heartbeat" not in log
    server.wait_for(lambda ws: any(w["worker_id"] == victim["worker_id"]
                                   and w["pid"] != victim["pid"] for w in ws),
                    timeout_s=WAIT_S, what="the victim restarted")
    back = next(w for w in server.workers() if w["worker_id"] == victim["worker_id"])
    log = server.log_tail(400)
    hello = log.find(f"worker ready worker_id={victim['worker_id']} pid={back['pid']}")
    assert 0 <= told < hello, log
