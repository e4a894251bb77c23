"""A worker whose device fails for good must not become a black hole (issue 35, item 2): a
step where nothing runs hands its requests back for failover (never "poison"), counts as a
failed step, and a worker that cannot step exits so that its supervisor replaces it. A
poison request, one that fails while the others of its batch run, still fails alone."""

from __future__ import annotations

from tests.worker.factories import make_engine
from tests.worker.test_process import gateway as gateway  # noqa: F401 (fixture)
from tests.worker.test_process import start, stop
from zeroserve.common.protocol import POISON_REQUEST, Submit


def break_device(engine) -> None:
    def broken(*args):
        raise RuntimeError("device lost")

    engine.runner.launch = engine.runner.execute = broken


def test_a_dead_device_hands_requests_back_and_the_worker_exits(gateway):  # noqa: F811
    engine = make_engine()
    worker, _, _ = start(gateway, engine, max_step_failures=3)
    break_device(engine)
    for rid in ("a", "b", "c"):  # each alone in its batch
        gateway.send(Submit(rid, [5, 6, 7], {"max_tokens": 4}, 8))
        outs = gateway.collect({rid}, timeout_s=30)[rid]
        assert [(o.finish_reason, o.error_code) for o in outs] == [("abort", None)], outs
        assert not any(o.new_token_ids for o in outs)
    assert worker.wait(timeout_s=30) == 1  # EXIT_ENGINE_FAILED: the supervisor restarts it


def test_a_dead_device_hands_back_every_request_of_a_batch(gateway):  # noqa: F811
    engine = make_engine({"forward_time_s": 0.005})
    worker, _, _ = start(gateway, engine, max_step_failures=3)
    gateway.send(Submit("a", [5, 6, 7], {"max_tokens": 50, "ignore_eos": True}, 64))
    gateway.send(Submit("b", [8, 9], {"max_tokens": 50, "ignore_eos": True}, 64))
    gateway.collect_n("a", 2)
    break_device(engine)
    outs = gateway.collect({"a", "b"}, timeout_s=30)
    for rid in ("a", "b"):
        assert outs[rid][-1].finish_reason == "abort", outs[rid]
        assert outs[rid][-1].error_code is None
    stop(gateway, worker)  # one failed step: the worker goes on


def test_a_poison_request_among_others_still_fails_alone(gateway):  # noqa: F811
    engine = make_engine({"forward_time_s": 0.002})
    worker, _, _ = start(gateway, engine, max_step_failures=1)
    runner = engine.runner
    real_launch, real_execute = runner.launch, runner.execute

    def launch(plan):
        if any(c.request_id == "poison" for c in plan.chunks):
            raise RuntimeError("device assert")
        real_launch(plan)

    def execute(plan):
        if any(c.request_id == "poison" for c in plan.chunks):
            raise RuntimeError("device assert")
        return real_execute(plan)

    runner.launch, runner.execute = launch, execute
    gateway.send(Submit("a", [5, 6, 7], {"max_tokens": 200, "ignore_eos": True}, 256))
    gateway.collect_n("a", 1)
    gateway.send(Submit("poison", [8, 9], {"max_tokens": 5}, 64))
    outs = gateway.collect({"a", "poison"}, timeout_s=60)
    assert [(o.finish_reason, o.error_code) for o in outs["poison"]] == [
        ("error", POISON_REQUEST)]
    assert outs["a"][-1].finish_reason == "length"
    stop(gateway, worker)  # max_step_failures=1, yet no step failed: still serving
