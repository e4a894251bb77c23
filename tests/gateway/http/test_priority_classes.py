"""Priority classes over HTTP: the key's class (limits file) is a ceiling a request's
`priority` can lower but never raise, on chat, completions, Responses and Messages; the
class reaches the worker in SUBMIT; an unknown class name is a 400; a class's share changes
through the admin API; /metrics shows the queue per class and per key."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.helpers import GatewayServer, cyclic_reply, wait_until
from zeroserve.cli.admin_client import AdminClient

pytestmark = pytest.mark.timeout(60)
GOLD, BULK, ADMIN = "sk-gold", "sk-bulk", "sk-admin"
MODEL = "tiny"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    limits = tmp_path_factory.mktemp("limits") / "limits.json"
    limits.write_text(json.dumps({
        GOLD: {"priority_class": "critical"},
        BULK: {"priority_class": "sheddable"},
    }))
    with GatewayServer(served_model_name=MODEL, api_keys=(GOLD, BULK),
                       admin_keys=(ADMIN,), rate_limits_file=str(limits)) as gw:
        worker = gw.worker(reply=cyclic_reply("ok ")).start()
        assert worker.ready.wait(5)
        yield gw, worker
        worker.stop()


def priority_of(served, key: str, path: str, body: dict) -> int:
    gw, worker = served
    before = len(worker.submits)
    r = httpx.post(gw.url + path, json={"model": MODEL, **body},
                   headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 200, r.text
    assert wait_until(lambda: len(worker.submits) > before, 5)
    return worker.submits[-1].priority


CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 2})
COMPLETION = ("/v1/completions", {"prompt": "hi", "max_tokens": 2})
RESPONSES = ("/v1/responses", {"input": "hi", "max_output_tokens": 2})
MESSAGES = ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2})


@pytest.mark.parametrize("path, body", [CHAT, COMPLETION, RESPONSES, MESSAGES],
                         ids=["chat", "completions", "responses", "messages"])
def test_a_request_may_lower_its_class_but_never_raise_it(served, path, body):
    # critical -1, standard 0, sheddable 1 on the wire (relative to the default class).
    assert priority_of(served, GOLD, path, body) == -1
    assert priority_of(served, GOLD, path, {**body, "priority": 1}) == 1
    assert priority_of(served, GOLD, path, {**body, "priority": "standard"}) == 0
    assert priority_of(served, BULK, path, body) == 1
    assert priority_of(served, BULK, path, {**body, "priority": -1}) == 1
    assert priority_of(served, BULK, path, {**body, "priority": "critical"}) == 1
    assert priority_of(served, BULK, path, {**body, "priority": -1000}) == 1


@pytest.mark.parametrize("priority", ["platinum", True, 1.5, [0], 2 ** 70])
def test_a_bad_priority_is_a_400(served, priority):
    gw, _ = served
    path, body = CHAT
    r = httpx.post(gw.url + path, json={"model": MODEL, **body, "priority": priority},
                   headers={"Authorization": f"Bearer {GOLD}"}, timeout=10)
    assert r.status_code == 400
    if priority != 2 ** 70:  # (that one the JSON reader refuses before any field is read)
        assert r.json()["error"]["param"] == "priority"


def test_shares_change_through_the_admin_api_and_metrics_show_the_classes(served):
    gw, _ = served
    admin = AdminClient(gw.url, ADMIN)
    found = admin.classes()
    assert found["policy"] == "fair"
    assert [c["name"] for c in found["classes"]] == ["critical", "standard", "sheddable"]
    answer = admin.set_share("sheddable", 0.5)
    assert {c["name"]: c["share"] for c in answer["classes"]}["sheddable"] == 0.5
    assert gw.gateway.admission._queue.shares()[2] == 0.5
    bad = httpx.post(gw.url + "/admin/classes/platinum/share", json={"share": 1},
                     headers={"Authorization": f"Bearer {ADMIN}"})
    assert bad.status_code == 404
    bad = httpx.post(gw.url + "/admin/classes/standard/share", json={"share": -1},
                     headers={"Authorization": f"Bearer {ADMIN}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "share"
    refused = httpx.post(gw.url + "/admin/classes/standard/share", json={"share": 1},
                         headers={"Authorization": f"Bearer {GOLD}"})
    assert refused.status_code in (401, 403)  # a serving key operates nothing
    text = httpx.get(gw.url + "/metrics", headers={"Authorization": f"Bearer {GOLD}"}).text
    assert 'zeroserve:priority_class_share{model_name="tiny",priority_class="sheddable"} 0.5' \
        in text
    for name in ("gateway_queue_requests", "gateway_shed_requests_total",
                 "gateway_queue_wait_seconds_bucket", "gateway_queue_requests_by_key"):
        assert f"zeroserve:{name}" in text


def test_a_stream_moved_to_another_worker_keeps_its_class():
    import threading

    with GatewayServer() as gw:  # no keys: the default class; the request lowers its own
        a = gw.worker(worker_id="a").start()
        assert a.ready.wait(5)
        a.is_stepping = False  # takes the request, then hangs before any token
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
            gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5,
                                              "priority": "sheddable"}, timeout=10)))
        t.start()
        assert wait_until(lambda: a.submits)
        b = gw.worker(worker_id="b").start()
        assert b.ready.wait(5)
        a.is_heartbeating = False  # ... and dies
        t.join(10)
        assert result["r"].status_code == 200
        assert [s.priority for s in a.submits + b.submits] == [1, 1]
        a.stop()
        b.stop()


def test_each_key_reaches_the_worker_as_a_flow_of_its_own(served):
    """SUBMIT.flow: the same for a key's requests, another for another key's (the worker
    shares a full batch's slots across them)."""
    gw, worker = served

    def flow_of(key: str) -> int:
        priority_of(served, key, *COMPLETION)
        return worker.submits[-1].flow

    gold = flow_of(GOLD)
    assert gold != 0 and flow_of(GOLD) == gold
    assert flow_of(BULK) not in (0, gold)


def test_fcfs_sends_no_flow():
    with GatewayServer(scheduling_policy="fcfs") as gw:
        worker = gw.worker().start()
        assert worker.ready.wait(5)
        r = httpx.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 200
        assert wait_until(lambda: worker.submits)
        assert worker.submits[-1].flow == 0
        worker.stop()


@pytest.mark.parametrize("path, body", [RESPONSES, CHAT], ids=["responses", "chat"])
def test_service_tier_maps_onto_the_classes_never_above_the_key(served, path, body):
    """OpenAI's service_tier: "priority" the best class the key allows, "default" the
    default class, "flex" the lowest, "auto" the key's own; an explicit `priority` wins."""
    expected = {GOLD: {"priority": -1, "default": 0, "flex": 1, "auto": -1, "scale": -1},
                BULK: {"priority": 1, "default": 1, "flex": 1, "auto": 1, "scale": 1}}
    for key, tiers in expected.items():
        for tier, priority in tiers.items():
            assert priority_of(served, key, path, {**body, "service_tier": tier}) == priority
    assert priority_of(served, GOLD, path, {**body, "service_tier": "flex",
                                            "priority": "standard"}) == 0
    gw, _ = served
    r = httpx.post(gw.url + path, json={"model": MODEL, **body, "service_tier": "turbo"},
                   headers={"Authorization": f"Bearer {GOLD}"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "service_tier"
