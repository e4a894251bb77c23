from __future__ import annotations

import random

import pytest

from tests.worker.factories import make_engine, make_params, prompt, run_to_completion
from zeroserve.common.protocol import POISON_REQUEST
from zeroserve.worker.config import BatchingMode
from zeroserve.worker.engine import StepFailed
from zeroserve.worker.sequence import FinishReason, RequestError

pytestmark = pytest.mark.timeout(60)


def test_generate_returns_max_tokens_for_each_prompt_deterministically():
    prompts = [prompt(5), prompt(40, start=300), prompt(17, start=700)]
    params = [make_params(max_tokens=n) for n in (3, 12, 30)]
    outputs = make_engine().generate(prompts, params)
    assert [len(o) for o in outputs] == [3, 12, 30]
    assert make_engine().generate(prompts, params) == outputs


@pytest.mark.parametrize("mode", list(BatchingMode))
def test_every_batching_mode_generates_the_same_tokens(mode):
    prompts = [prompt(n, start=50 * n) for n in (3, 9, 30, 64, 5)]
    params = [make_params(max_tokens=n) for n in (20, 4, 9, 13, 1)]
    reference = make_engine().generate(prompts, params)
    engine = make_engine(batching_mode=mode, batch_wait_ms=1.0, max_num_seqs=3)
    assert engine.generate(prompts, params) == reference
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_tokens_are_emitted_once_even_across_preemption():
    prompts = [prompt(20, start=100 * i) for i in range(6)]
    params = make_params(max_tokens=24)
    reference = make_engine(num_kv_blocks=200).generate(prompts, params)
    tight = make_engine(num_kv_blocks=14, max_num_seqs=6)
    outputs = tight.generate(prompts, params)
    assert tight.stats().num_preemptions > 0
    assert outputs == reference


def test_abort_mid_way_frees_blocks_and_is_reported_once():
    engine = make_engine()
    total = engine.stats().num_total_blocks
    engine.add_request("a", prompt(30), make_params(max_tokens=50))
    engine.add_request("b", prompt(10, start=900), make_params(max_tokens=3))
    for _ in range(5):
        engine.step()
    assert engine.stats().num_free_blocks < total
    assert engine.abort("a")
    assert not engine.abort("a")
    assert engine.stats().num_free_blocks == total  # b finished already; a's blocks are back
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", FinishReason.ABORT)]
    assert not engine.has_unfinished()
    assert engine.step() == []


def test_step_outputs_carry_counts_finish_reason_and_logprobs():
    engine = make_engine()
    engine.add_request("r", prompt(6), make_params(max_tokens=2, logprobs=3))
    first = engine.step()
    second = engine.step()
    assert [len(o.new_token_ids) for o in first + second] == [1, 1]
    assert first[0].finish_reason is None
    assert second[0].finish_reason is FinishReason.LENGTH
    assert second[0].num_output_tokens == 2 and second[0].num_prompt_tokens == 6
    logprob, top = second[0].logprobs[0]
    assert logprob < 0 and len(top) == 3 and top[0][0] == second[0].new_token_ids[0]


def test_eos_stops_unless_ignored():
    engine = make_engine(runner_kwargs={"eos_after": 3})
    stopped, ignored = engine.generate(
        [prompt(4), prompt(4)],
        [make_params(max_tokens=10), make_params(ignore_eos=True, max_tokens=10)],
    )
    assert len(stopped) == 4 and stopped[-1] == engine.info.eos_token_ids[0]
    assert len(ignored) == 10


def test_bad_requests_are_rejected_with_user_facing_errors():
    engine = make_engine(max_model_len=64)
    engine.add_request("dup", prompt(4), make_params())
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("dup", prompt(4), make_params())
    with pytest.raises(RequestError, match="at least one token"):
        engine.add_request("empty", [], make_params())
    with pytest.raises(RequestError, match=r"in \[0, 49152\)"):
        engine.add_request("oov", [49152], make_params())
    with pytest.raises(RequestError) as error:
        engine.add_request("long", prompt(60), make_params(max_tokens=10))
    assert str(error.value).startswith(
        "This model's maximum context length is 64 tokens. However, you requested 70 tokens "
        "(60 in the messages, 10 in the completion)."
    )


def test_max_model_len_is_capped_by_the_pool():
    engine = make_engine(num_kv_blocks=8, block_size=4, max_model_len=1000)
    assert engine.max_model_len == 32
    with pytest.raises(RequestError, match="maximum context length is 32"):
        engine.add_request("big", prompt(20), make_params(max_tokens=13))


def test_stats_report_queues_blocks_and_step_timing():
    engine = make_engine(max_num_seqs=2, runner_kwargs={"forward_time_s": 0.002})
    for i in range(3):
        engine.add_request(f"r{i}", prompt(8, start=100 * i), make_params(max_tokens=4))
    engine.step()
    engine.pause("r0")
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_paused) == (1, 1, 1)
    assert stats.num_free_blocks == stats.num_total_blocks - 4
    assert stats.num_steps == 1
    assert stats.last_step.num_seqs == 2 and stats.last_step.num_tokens == 16
    assert stats.last_step.forward_s >= 0.002
    assert stats.last_step.total_s >= stats.last_step.forward_s
    engine.resume("r0")
    run_to_completion(engine)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_cached_blocks > 0  # full prompt blocks stay reusable


def test_a_shared_prefix_is_not_computed_again():
    engine = make_engine()
    system = prompt(32, start=1000)
    engine.generate([system + [5, 6, 7]], make_params(max_tokens=2))
    before = engine.runner.num_computed_tokens
    engine.add_request("second", system + [8, 9], make_params(max_tokens=2))
    result = run_to_completion(engine)
    assert engine.runner.num_computed_tokens - before == 2 + 1  # 2 new prompt tokens + 1 decode
    assert result["finished"]["second"][0].num_cached_tokens == 32


@pytest.mark.parametrize("failing", ["launch", "collect"])
def test_runner_failure_fails_the_batch_and_the_engine_keeps_serving(failing):
    engine = make_engine()
    engine.add_request("a", prompt(4), make_params(max_tokens=5))
    engine.step()
    real = getattr(engine.runner, failing)

    def broken(*args):
        raise RuntimeError("device lost")

    setattr(engine.runner, failing, broken)
    # Alone in its batch, nothing tells a poison request from a failed device: the step
    # failed, and the request is the caller's to hand back (the worker aborts it here).
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert failed.value.request_ids == ["a"]
    assert engine.abort("a")
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason, o.error_code) for o in outputs] == [
        ("a", FinishReason.ABORT, None)]
    setattr(engine.runner, failing, real)
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
    assert engine.generate([prompt(4)], make_params(max_tokens=3))[0]


@pytest.mark.parametrize("failing", ["launch", "collect"])
def test_a_request_that_fails_the_runner_fails_alone_and_its_batch_goes_on(failing):
    """A request that makes every batch holding it raise (a poison request) is found by
    running the failed batch one request at a time: it alone ends with ERROR and the
    code that tells the gateway not to move it; the others' tokens are an undisturbed run's."""
    reference = make_engine().generate([prompt(4, start=10), prompt(6, start=20)],
                                       make_params(max_tokens=6))
    engine = make_engine()
    engine.add_request("a", prompt(4, start=10), make_params(max_tokens=6))
    engine.add_request("poison", prompt(5, start=30), make_params(max_tokens=6))
    engine.add_request("b", prompt(6, start=20), make_params(max_tokens=6))
    runner = engine.runner
    real_launch, real_collect = runner.launch, runner.collect
    planned: list[list[str]] = []

    def launch(plan):
        planned.append([c.request_id for c in plan.chunks])
        if failing == "launch" and "poison" in planned[-1]:
            raise RuntimeError("device assert")
        real_launch(plan)

    def collect():
        sampled = real_collect()
        if failing == "collect" and "poison" in planned[-1]:
            raise RuntimeError("device assert")
        return sampled

    runner.launch, runner.collect = launch, collect
    result = run_to_completion(engine)
    poison = result["finished"]["poison"]
    assert [o.finish_reason for o in poison] == [FinishReason.ERROR]
    assert poison[0].error_code == POISON_REQUEST and not result["tokens"].get("poison")
    assert result["tokens"]["a"] == reference[0] and result["tokens"]["b"] == reference[1]
    assert [o.finish_reason for o in result["finished"]["a"] + result["finished"]["b"]] == [
        FinishReason.LENGTH, FinishReason.LENGTH]
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_a_device_that_fails_every_request_fails_the_step_without_calling_them_poison():
    engine = make_engine()
    engine.add_request("a", prompt(4, start=10), make_params(max_tokens=6))
    engine.add_request("b", prompt(6, start=20), make_params(max_tokens=6))

    def broken(plan):
        raise RuntimeError("device lost")

    engine.runner.launch = engine.runner.execute = broken
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert sorted(failed.value.request_ids) == ["a", "b"]
    assert engine.take_outputs() == []  # nobody failed as poison
    for rid in ("a", "b"):
        assert engine.abort(rid)
    engine.step()
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_random_stress_keeps_the_pool_consistent_and_finishes_everything():
    rng = random.Random(1234)
    engine = make_engine(
        num_kv_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=20, max_model_len=80
    )
    bm = engine.block_manager
    total = bm.num_total_blocks
    shared = prompt(12, start=4000)
    expected: dict[str, int] = {}
    aborted: set[str] = set()
    seen_tokens: dict[str, int] = {}
    finished: dict[str, FinishReason] = {}
    next_id = 0
    for step in range(3000):
        if step < 400 and rng.random() < 0.4:
            rid = f"s{next_id}"
            next_id += 1
            head = shared if rng.random() < 0.5 else []
            tokens = head + [rng.randrange(3, 49152) for _ in range(rng.randrange(1, 40))]
            max_tokens = rng.randrange(1, 80 - len(tokens) + 1)
            engine.add_request(rid, tokens, make_params(max_tokens=max_tokens))
            expected[rid] = max_tokens
        live = [rid for rid in expected if rid not in finished and rid not in aborted]
        if live and rng.random() < 0.05:
            rid = rng.choice(live)
            assert engine.abort(rid)
            aborted.add(rid)
        if live and rng.random() < 0.1:
            engine.pause(rng.choice(live))
        if rng.random() < 0.3:
            for rid in list(engine.scheduler.paused):
                engine.resume(rid)
        for output in engine.step():
            seen_tokens[output.request_id] = seen_tokens.get(output.request_id, 0) + len(
                output.new_token_ids
            )
            assert output.num_output_tokens == seen_tokens[output.request_id]
            if output.is_finished:
                assert output.request_id not in finished, "finished reported twice"
                finished[output.request_id] = output.finish_reason
        # Invariants: the pool is never exceeded and held blocks match the block tables.
        assert 0 <= bm.num_free_blocks <= total
        held = {b for seq in engine.scheduler._requests.values() for b in seq.block_table}
        assert bm.num_used_blocks == len(held)
        if step >= 400 and not engine.has_unfinished():
            break
    for rid in list(engine.scheduler.paused):
        engine.resume(rid)
    run_to_completion(engine)
    assert set(finished) == set(expected)
    for rid, max_tokens in expected.items():
        if rid in aborted:
            assert finished[rid] is FinishReason.ABORT
            assert seen_tokens.get(rid, 0) <= max_tokens
        else:
            assert finished[rid] is FinishReason.LENGTH
            assert seen_tokens[rid] == max_tokens
    assert engine.stats().num_preemptions > 0
    assert bm.num_free_blocks == total


def test_a_paused_request_emits_nothing_until_resumed():
    engine = make_engine()
    engine.add_request("slow", prompt(6), make_params(max_tokens=6))
    engine.add_request("fast", prompt(6, start=500), make_params(max_tokens=6))
    engine.step()
    assert engine.pause("slow")
    for _ in range(3):
        assert [o.request_id for o in engine.step()] == ["fast"]
    assert engine.resume("slow")
    result = run_to_completion(engine)
    assert len(result["tokens"]["slow"]) == 5  # the 5 it still owed; the first came earlier
    assert not engine.pause("fast") and not engine.resume("fast")  # finished: unknown now


def _continued(engine, params, full: list[int], num_done: int) -> tuple[list[int], list]:
    """Resume a request from the first num_done of its tokens, as failover does."""
    engine.add_request("moved", prompt(12), params, output_token_ids=full[:num_done])
    result = run_to_completion(engine)
    return result["tokens"]["moved"], result["finished"]["moved"]


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=11)])
def test_a_stream_resumed_from_its_tokens_continues_exactly(sampling):
    params = make_params(max_tokens=24, **sampling)
    full = make_engine().generate([prompt(12)], params)[0]
    rest, finished = _continued(make_engine(), params, full, 9)
    # Not emitted again; the rest equals the undisturbed run; counts include what came before.
    assert rest == full[9:]
    assert finished[-1].num_output_tokens == 24 and finished[-1].finish_reason.value == "length"


def test_resuming_a_finished_or_bad_continuation_is_refused():
    engine = make_engine()
    with pytest.raises(RequestError):
        engine.add_request("a", prompt(4), make_params(max_tokens=3), output_token_ids=[5, 6, 7])
    with pytest.raises(RequestError):
        engine.add_request("b", prompt(4), make_params(max_tokens=9), output_token_ids=[10**9])
