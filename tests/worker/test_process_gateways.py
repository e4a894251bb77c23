"""A worker behind two gateway processes (`zeroserve serve --gateways 2`): each stream's
tokens go only to the gateway that submitted it, each gateway's heartbeats list only its own
streams, and the loss of one gateway (a restart, or silence past the grace period) ends only
that gateway's streams."""

from __future__ import annotations

import hashlib
import time

import pytest

from tests.worker.test_process import (
    WORKER_ID,
    FakeGateway,
    RunningWorker,
    ScriptedEngine,
    start,
    stop,
)
from zeroserve.common.protocol import Credit, Heartbeat, Hello, Ready, Submit, decode
from zeroserve.worker.config import WorkerConfig


@pytest.fixture
def gateways(tmp_path):
    pair = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        pair.append(FakeGateway(tmp_path / name, WORKER_ID))
    yield pair
    for gw in pair:
        gw.close()


def start_two(gateways, **overrides):
    a, b = gateways
    engine = ScriptedEngine()
    config = WorkerConfig(
        worker_id=WORKER_ID, router_address=(a.router_address, b.router_address),
        tokens_address=(a.tokens_address, b.tokens_address), heartbeat_interval_s=0.05,
        **overrides)
    worker = RunningWorker(config, engine)
    for gw, gateway_id in ((a, "gw-a"), (b, "gw-b")):
        gw.recv(Hello)
        gw.send(Ready(True, "", 0.05, gateway_id))
    return worker, engine


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_each_gateway_gets_only_its_own_streams_and_a_restart_of_one_spares_the_other(
        gateways):
    a, b = gateways
    worker, engine = start_two(gateways)
    a.send(Submit("on-a", [1], {"max_tokens": 6}, 3))
    b.send(Submit("on-b", [1], {"max_tokens": 1000}, 2))
    assert tokens_of(a.collect_n("on-a", 3)) == [101, 102, 103]
    assert tokens_of(b.collect_n("on-b", 2)) == [101, 102]
    # Credit from the other gateway does not touch a stream; its own gateway's does.
    b.send(Credit([["on-a", 6]]))
    assert a.tokens(timeout_s=0.3) is None
    # Heartbeats: the worker's whole load, each gateway's own request ids.
    beat_a, beat_b = a.beat_after(time.time()), b.beat_after(time.time())
    assert beat_a.request_ids == ["on-a"] and beat_b.request_ids == ["on-b"]
    assert beat_a.num_running + beat_a.num_paused == 2 == beat_b.num_running + beat_b.num_paused
    # Gateway b restarts: its stream is dropped, a's goes on.
    b.send(Heartbeat(WORKER_ID, "unknown", gateway_id="gw-b2"))
    outs_b = b.collect({"on-b"}, timeout_s=2)["on-b"]
    assert outs_b[-1].finish_reason == "abort" and "restarted" in outs_b[-1].error
    a.send(Credit([["on-a", 6]]))
    outs_a = a.collect({"on-a"})["on-a"]
    assert tokens_of(outs_a) == [104, 105, 106] and outs_a[-1].finish_reason == "length"
    assert not engine.reqs
    stop(a, worker)


def test_silence_of_one_gateway_past_its_grace_fails_only_its_streams(gateways):
    a, b = gateways
    worker, engine = start_two(gateways, gateway_timeout_s=0.2, gateway_grace_s=0.6)
    a.send(Submit("on-a", [1], {"max_tokens": 8}, 4))
    b.send(Submit("on-b", [1], {"max_tokens": 1000}, 2))
    b.collect_n("on-b", 2)
    assert tokens_of(a.collect_n("on-a", 4)) == [101, 102, 103, 104]
    # Gateway a keeps talking (its heartbeats) until b's stream ends (b's grace runs out:
    # 0.8 s, polled up to 10 s for a loaded machine); gateway b says nothing from here on.
    outs_b: list = []
    deadline = time.monotonic() + 10
    while not (outs_b and outs_b[-1].finish_reason) and time.monotonic() < deadline:
        a.send(Heartbeat("gateway", gateway_id="gw-a"))
        msg = b.tokens(timeout_s=0.05)
        outs_b += [o for o in msg.outputs if o.request_id == "on-b"] if msg else []
    assert outs_b[-1].finish_reason == "abort" and "gateway" in outs_b[-1].error
    assert list(engine.reqs) == ["on-a"]
    a.send(Credit([["on-a", 8]]))
    outs_a = a.collect({"on-a"})["on-a"]
    assert tokens_of(outs_a) == [105, 106, 107, 108] and outs_a[-1].finish_reason == "length"
    stop(a, worker)


def test_every_gateway_knows_one_process_by_the_same_route_and_a_new_one_by_another(
        gateways):
    """Each gateway names a worker process by its route (the `incarnation` in GET
    /admin/workers), so `zeroserve workers restart` polling whichever gateway answers sees
    one name per process: the same through both gateways, and a new one after a restart."""
    a, b = gateways
    worker, _ = start_two(gateways)
    first = a.route
    assert first == b.route
    stop(a, worker)
    worker, _ = start_two(gateways)  # the next run, as its supervisor would start it
    assert a.route == b.route != first
    stop(a, worker)


def test_config_pairs_router_and_tokens_addresses():
    with pytest.raises(ValueError, match="tokens"):
        WorkerConfig("w", ("ipc://a", "ipc://b"), "ipc://c")
    with pytest.raises(ValueError, match="different"):
        WorkerConfig("w", ("ipc://a", "ipc://a"), ("ipc://b", "ipc://c"))
    assert WorkerConfig("w", ("ipc://a", "ipc://b"), ("ipc://c", "ipc://d")
                        ).gateway_endpoints == [("ipc://a", "ipc://c"), ("ipc://b", "ipc://d")]



def test_the_tokens_socket_names_this_process_as_gateways_do(tmp_path):
    """A gateway lets only the process bound to a worker id move that id's TOKENS sequence:
    the PULL side has no routes, so the worker names its process in the connection's
    metadata, as the gateway names it from the route (WorkerHandle.incarnation)."""
    gateway = FakeGateway(tmp_path, WORKER_ID)
    try:
        worker, _, _ = start(gateway)
        gateway.send(Submit("a", [1], {"max_tokens": 2}, 8))
        assert gateway.pull.poll(5000)
        frames = gateway.pull.recv_multipart(copy=False)
        assert decode([f.bytes for f in frames]).worker_id == WORKER_ID
        assert gateway.route is not None
        assert frames[0].get("X-Incarnation") == hashlib.sha256(gateway.route).hexdigest()[:12]
        stop(gateway, worker)
    finally:
        gateway.close()
