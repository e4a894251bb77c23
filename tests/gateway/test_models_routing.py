"""Several models behind one gateway (the real app on uvicorn, fake workers over real ZeroMQ):
routing by name and version, the 404, /v1/models, an alias's split and stickiness, a live
weight change, a v1 -> v2 switch under load, and failover that never changes model or
version."""

from __future__ import annotations

import concurrent.futures
import itertools

import httpx
import pytest

from tests.gateway.helpers import GatewayServer, byte_tokenizer, fixed_reply, wait_until
from zeroserve.cli.admin_client import AdminClient
from zeroserve.gateway.workers.models import Target, parse_alias, stable_point

REPLY = "Hello from a fake model."
# The alias's canary share over SPLIT_REQUESTS conversations, each its own `user`: the keys
# are fixed, so the count is too; the tolerance is 3 sigma of a binomial at 80 (the
# precise split over 20,000 keys is tests/gateway/workers/test_models.py).
SPLIT_REQUESTS = 80
SPLIT_TOLERANCE = 0.1


def serving(**overrides) -> GatewayServer:
    config = dict(served_model_name="smollm", extra_models=("tiny=/nonexistent/tiny.gguf",),
                  model_aliases=("chat=smollm@v1:90,smollm@v2:10",))
    config.update(overrides)
    return GatewayServer(tokenizers={"tiny": byte_tokenizer()}, **config)


def start(gw: GatewayServer, worker_id: str, model: str, version: str, **kwargs):
    kwargs.setdefault("reply", fixed_reply(REPLY))
    worker = gw.worker(worker_id=worker_id, served_model_name=model, model_version=version,
                       **kwargs).start()
    assert worker.ready.wait(5), worker.refused_reason
    return worker


@pytest.fixture
def fleet():
    """smollm v1 and v2 (the default model, under its served name) and tiny v1."""
    with serving() as gw:
        workers = {"v1": start(gw, "smollm-v1", "smollm", "v1"),
                   "v2": start(gw, "smollm-v2", "smollm", "v2"),
                   "tiny": start(gw, "tiny-v1", "tiny", "v1")}
        yield gw, workers
        for worker in workers.values():
            worker.stop()


def complete(gw: GatewayServer, model: str | None, **body) -> httpx.Response:
    payload = {"prompt": "hi", "max_tokens": 4, **body}
    if model is not None:
        payload["model"] = model
    return httpx.post(f"{gw.url}/v1/completions", json=payload, timeout=10)


def who_served(workers: dict, before: dict[str, int]) -> list[str]:
    return [name for name, w in workers.items() if len(w.submits) > before[name]]


def counts(workers: dict) -> dict[str, int]:
    return {name: len(w.submits) for name, w in workers.items()}


def test_requests_go_to_their_models_workers(fleet):
    gw, workers = fleet
    for model, expected in [("tiny", {"tiny"}), ("smollm@v2", {"v2"}), ("smollm@v1", {"v1"}),
                            ("smollm", {"v1", "v2"}), (None, {"v1", "v2"}),
                            ("SmolLM2-135M-Instruct", {"v1", "v2"})]:
        before = counts(workers)
        response = complete(gw, model)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == "Hell"
        served = who_served(workers, before)
        assert len(served) == 1 and served[0] in expected, (model, served)
    chat = httpx.post(f"{gw.url}/v1/chat/completions", timeout=10, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["model"] == "tiny"
    before = counts(workers)
    message = httpx.post(f"{gw.url}/v1/messages", timeout=10, json={
        "model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert message.status_code == 200 and who_served(workers, before) == ["tiny"]
    before = counts(workers)
    response = httpx.post(f"{gw.url}/v1/responses", timeout=10, json={
        "model": "smollm@v2", "input": "hi", "max_output_tokens": 3})
    assert response.status_code == 200 and who_served(workers, before) == ["v2"]


def test_an_unknown_model_is_a_404_in_openais_shape(fleet):
    gw, workers = fleet
    before = counts(workers)
    response = complete(gw, "gpt-x")
    assert response.status_code == 404
    assert response.json() == {"error": {
        "message": "The model `gpt-x` does not exist.", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}}
    assert httpx.get(f"{gw.url}/v1/models/gpt-x").status_code == 404
    message = httpx.post(f"{gw.url}/v1/messages", timeout=10, json={
        "model": "gpt-x", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert message.status_code == 404 and message.json()["type"] == "error"
    assert counts(workers) == before


def test_models_lists_every_model_and_alias(fleet):
    gw, _ = fleet
    cards = {c["id"]: c for c in httpx.get(f"{gw.url}/v1/models").json()["data"]}
    assert list(cards) == ["smollm", "tiny", "chat"]
    assert cards["smollm"]["versions"] == ["v1", "v2"] and cards["tiny"]["versions"] == ["v1"]
    assert cards["chat"]["weights"] == {"smollm@v1": 90.0, "smollm@v2": 10.0}
    assert httpx.get(f"{gw.url}/v1/models/tiny").json()["id"] == "tiny"
    listing = AdminClient(gw.url).models()
    assert [m["model"] for m in listing["models"]] == ["smollm", "tiny"]
    assert listing["models"][0]["versions"][1]["workers"] == [
        {"worker_id": "smollm-v2", "status": "ready"}]


def served_prompts(workers: dict) -> dict[str, list[str]]:
    """Worker name -> the prompts (as text) it was sent, in order."""
    return {name: [bytes(s.prompt_token_ids).decode() for s in w.submits]
            for name, w in workers.items()}


def test_an_alias_splits_by_weight_and_sticks_per_conversation(fleet):
    gw, workers = fleet

    def send(i: int, repeat: int = 0) -> int:
        return complete(gw, "chat", prompt=f"user-{i}/{repeat}", user=f"user-{i}",
                        max_tokens=1).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert set(pool.map(send, range(SPLIT_REQUESTS))) == {200}
        # the same conversations again: each to the version it had
        assert set(pool.map(send, range(0, SPLIT_REQUESTS, 10), [1] * 8)) == {200}
    prompts = served_prompts(workers)
    assert prompts["tiny"] == []
    on_v2 = {p.split("/")[0] for p in prompts["v2"]}
    on_v1 = {p.split("/")[0] for p in prompts["v1"]}
    assert not on_v1 & on_v2  # sticky: no conversation on both
    share = len(on_v2) / SPLIT_REQUESTS
    assert abs(share - 0.10) < SPLIT_TOLERANCE, share
    # exactly the conversations whose key hashes into v2's tenth of [0, 1)
    alias = parse_alias("chat=smollm@v1:90,smollm@v2:10")
    assert on_v2 == {f"user-{i}" for i in range(SPLIT_REQUESTS)
                     if alias.pick(f"user-{i}") == Target("smollm", "v2")}
    sticky = []  # a session header and prompt_cache_key stick too
    for _ in range(5):
        before = counts(workers)
        httpx.post(f"{gw.url}/v1/completions", headers={"x-session-id": "s-1"}, timeout=10,
                   json={"model": "chat", "prompt": "hi", "max_tokens": 1})
        sticky += who_served(workers, before)
    assert len(set(sticky)) == 1


def test_weights_change_live_through_the_admin_api(fleet):
    gw, workers = fleet
    admin = AdminClient(gw.url)
    answer = admin.set_weights("chat", {"smollm@v2": 100, "smollm@v1": 0})
    assert answer["shares"] == {"smollm@v2": 1.0, "smollm@v1": 0.0}
    for i in range(20):
        before = counts(workers)
        complete(gw, "chat", user=f"user-{i}", max_tokens=1)
        assert who_served(workers, before) == ["v2"]
    bad = httpx.post(f"{gw.url}/admin/models/chat/weights", json={"weights": {"gpt": 1}})
    assert bad.status_code == 400 and "not a served model" in bad.json()["error"]["message"]
    bad = httpx.post(f"{gw.url}/admin/models/chat/weights", json={"weights": {"tiny": -1}})
    assert bad.status_code == 400
    assert httpx.get(f"{gw.url}/v1/models/chat").json()["weights"] == {
        "smollm@v2": 100.0, "smollm@v1": 0.0}


def test_an_alias_over_the_models_display_name_is_listed(tmp_path):
    """An alias may name the default model by its file's display name: /v1/models lists it
    (it was a 500 on every call), whether it came from a flag, the admin API or the tier's
    shared file written by another gateway."""
    path = tmp_path / "aliases.json"
    with serving(model_aliases=("chat=SmolLM2-135M-Instruct@v1:1",),
                 aliases_file=str(path)) as gw:
        worker = start(gw, "smollm-v1", "smollm", "v1")
        try:
            models = httpx.get(f"{gw.url}/v1/models")
            assert models.status_code == 200, models.text
            cards = {c["id"]: c for c in models.json()["data"]}
            assert cards["chat"]["weights"] == {"smollm@v1": 1.0}
            set_ = AdminClient(gw.url).set_weights("fast", {"SmolLM2-135M-Instruct": 1})
            assert set_["weights"] == {"smollm": 1.0}
            # Another gateway of the tier writes the display name into the shared file.
            path.write_text('{"aliases": {"other": {"SmolLM2-135M-Instruct@v1": 5}}}')
            assert wait_until(lambda: httpx.get(f"{gw.url}/v1/models/other").status_code == 200,
                              timeout=30)
            cards = {c["id"]: c for c in httpx.get(f"{gw.url}/v1/models").json()["data"]}
            assert cards["other"]["weights"] == {"smollm@v1": 5.0}
            for name in ("chat", "fast", "other"):
                assert httpx.get(f"{gw.url}/v1/models/{name}").status_code == 200
                assert complete(gw, name).status_code == 200
        finally:
            worker.stop()


def test_weights_out_of_bounds_are_refused_and_serving_goes_on(tmp_path):
    """10**400 (and 1e400) in an admin call is a 400; written into the tier's file it is left
    out: the gateway starts with such a file, and aliased requests keep their weights."""
    path = tmp_path / "aliases.json"
    path.write_text('{"aliases": {"chat": {"smollm@v2": 1%s}}}' % ("0" * 400))
    with serving(aliases_file=str(path)) as gw:  # it was an OverflowError at start
        worker = start(gw, "smollm-v1", "smollm", "v1")
        try:
            # The flag's weights: a conversation whose point falls in v1's 90% (a random
            # pick meets v2, which has no worker, 1 time in 10 and waits out the queue).
            user = next(f"u{i}" for i in itertools.count() if stable_point(f"u{i}") < 0.9)
            assert complete(gw, "chat", user=user).status_code == 200
            for raw in (b'{"weights": {"smollm@v2": 1%s}}' % (b"0" * 400),
                        b'{"weights": {"smollm@v2": 1e400}}'):
                bad = httpx.post(f"{gw.url}/admin/models/chat/weights", content=raw,
                                 headers={"Content-Type": "application/json"})
                assert bad.status_code == 400, bad.text
                assert "at most 1,000,000" in bad.json()["error"]["message"]
            path.write_text('{"aliases": {"chat": {"smollm@v1": 1%s}, "seen": {"smollm": 1}}}'
                            % ("0" * 400))
            assert wait_until(lambda: complete(gw, "seen").status_code == 200, timeout=30)
            # Polled too: on a loaded machine (the suite's two processes) the fake worker's
            # heartbeat can come late and a request meet a 503 for a moment.
            assert wait_until(lambda: complete(gw, "chat", user=user).status_code == 200,
                              timeout=30)
            assert httpx.get(f"{gw.url}/v1/models").status_code == 200
        finally:
            worker.stop()


def test_a_version_switch_under_load_fails_no_request():
    """v1 serves the alias; v2 starts, the weights move to it, v1 drains: every request of
    a steady load succeeds, and new ones end up on v2 only."""
    with serving(model_aliases=("chat=smollm@v1:100",)) as gw:
        v1 = start(gw, "smollm-v1", "smollm", "v1", step_s=0.01)
        admin = AdminClient(gw.url)
        results: list[int] = []

        def one(i: int) -> int:
            with httpx.stream("POST", f"{gw.url}/v1/completions", timeout=20, json={
                    "model": "chat", "prompt": "hi", "stream": True, "max_tokens": 20,
                    "user": f"u{i}"}) as response:
                body = "".join(response.iter_text())
            assert "[DONE]" in body and '"error"' not in body, body[-300:]
            return response.status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(one, i) for i in range(16)]
            v2 = start(gw, "smollm-v2", "smollm", "v2", step_s=0.01)
            admin.set_weights("chat", {"smollm@v2": 1})
            admin.drain("smollm-v1", 10)
            futures += [pool.submit(one, i) for i in range(16, 48)]
            results = [f.result() for f in futures]
        assert results == [200] * 48
        num_v1 = len(v1.submits)
        assert all(complete(gw, "chat", user=f"late-{i}").status_code == 200 for i in range(5))
        assert len(v1.submits) == num_v1 and len(v2.submits) >= 5
        v1.stop()
        v2.stop()


def test_a_lost_workers_streams_fail_over_only_to_the_same_model_and_version():
    with serving(queue_timeout_s=1.5) as gw:
        tiny_a = start(gw, "tiny-a", "tiny", "v1", step_s=0.05, reply=fixed_reply(REPLY * 4))
        smollm = start(gw, "smollm-v1", "smollm", "v1")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(lambda: complete(gw, "tiny", max_tokens=60))
            assert wait_until(lambda: tiny_a.streams, 5)
            tiny_b = start(gw, "tiny-b", "tiny", "v1", reply=fixed_reply(REPLY * 4))
            tiny_a.stop()  # lost: its stream moves on
            response = future.result(timeout=15)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == (REPLY * 4)[:60]
        assert len(tiny_b.submits) == 1 and tiny_b.submits[0].output_token_ids
        assert smollm.submits == []  # never another model's worker
        # A stream on smollm@v1 whose worker is lost waits for v1, never v2: 503 at last.
        smollm_v2 = start(gw, "smollm-v2", "smollm", "v2")
        admin = AdminClient(gw.url)  # (the gateway's sockets are its loop's alone)
        admin.drain("smollm-v2", 0)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            smollm.step_s = 0.05
            smollm.reply = fixed_reply(REPLY * 4)
            future = pool.submit(lambda: complete(gw, "smollm", max_tokens=60))
            assert wait_until(lambda: smollm.streams, 5)
            admin.undrain("smollm-v2")
            smollm.stop()
            response = future.result(timeout=15)
        assert response.status_code == 503
        assert smollm_v2.submits == []
        for worker in (tiny_b, smollm_v2):
            worker.stop()


def test_a_worker_of_a_model_the_gateway_does_not_serve_is_refused():
    with serving() as gw:
        worker = gw.worker(worker_id="stranger", served_model_name="llama-70b").start()
        assert wait_until(lambda: worker.refused_reason is not None, 5)
        assert "does not serve model 'llama-70b'" in worker.refused_reason
        worker.stop()


def test_a_model_without_workers_waits_then_503s_without_holding_up_the_others():
    # Served while the tiny request still waits (behind it, it would end only after that
    # one's 503): no wall-clock bound, which a loaded machine's slow request could miss.
    with serving(queue_timeout_s=5.0) as gw:
        smollm = start(gw, "smollm-v1", "smollm", "v1")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            waiting = pool.submit(complete, gw, "tiny")  # no tiny worker: it queues
            assert wait_until(lambda: gw.gateway.admission.num_queued == 1, 5)
            assert complete(gw, "smollm").status_code == 200  # not behind it in the queue
            assert not waiting.done() and gw.gateway.admission.num_queued == 1
            refused = waiting.result(timeout=20)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_worker"
        smollm.stop()
