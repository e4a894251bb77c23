"""n > 1 choices of one prompt (n SUBMITs with equal prompts) prefill the prompt once: the
others wait for the first one's prompt blocks and share them through the prefix cache
(reference counts), recomputing only the last, partly filled block. The fake runner checks
every plan's KV contents, so a wrongly shared block fails these tests."""

from __future__ import annotations

from tests.worker.factories import make_config
from zeroserve.worker.engine import Engine
from zeroserve.worker.fake_runner import FakeRunner
from zeroserve.worker.sequence import SamplingParams

PROMPT = list(range(100, 150))  # 50 tokens: 12 full blocks of 4 and a partial one


def run(config, prompts_and_params, steps_between: int = 0):
    runner = FakeRunner(config)
    engine = Engine(config, runner=runner)
    outputs: dict[str, list[int]] = {}
    shared_blocks = 0
    for i, (prompt, params) in enumerate(prompts_and_params):
        engine.add_request(f"r{i}", prompt, params)
        outputs[f"r{i}"] = []
        for _ in range(steps_between):
            engine.step()
    while engine.has_unfinished():
        shared_blocks = max(shared_blocks, sum(
            1 for b in range(runner.num_kv_blocks) if engine.block_manager.ref_count(b) > 1))
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    return [outputs[f"r{i}"] for i in range(len(prompts_and_params))], runner, shared_blocks


def choices(n: int, max_tokens: int = 6):
    return [(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i))
            for i in range(n)]


def test_n_choices_prefill_their_prompt_once():
    config = make_config(max_num_batched_tokens=64)
    tokens, runner, shared = run(config, choices(4))
    # One prompt, then per other choice only the 2 tokens of the partial last block; plus
    # one token per decode step of each choice.
    num_decodes = 4 * 5
    assert runner.num_computed_tokens == len(PROMPT) + 3 * (len(PROMPT) % 4) + num_decodes
    assert shared == len(PROMPT) // 4  # the full prompt blocks, held by all four at once
    # The same tokens as four separate requests, each computing its own prompt.
    alone = [run(make_config(enable_prefix_caching=False), [c])[0][0] for c in choices(4)]
    assert tokens == alone


def test_without_prefix_caching_every_choice_prefills():
    tokens, runner, _ = run(make_config(max_num_batched_tokens=64,
                                        enable_prefix_caching=False), choices(3))
    assert runner.num_computed_tokens == 3 * len(PROMPT) + 3 * 5


def test_a_waiting_sibling_does_not_hold_up_other_prompts():
    """Behind a sibling waiting for its leader's prefill, another prompt is admitted."""
    config = make_config(max_num_batched_tokens=40, max_num_seqs=8)
    other = list(range(300, 306))
    requests = choices(2) + [(other, SamplingParams(max_tokens=3, temperature=0.0))]
    runner = FakeRunner(config)
    engine = Engine(config, runner=runner)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()  # r0 takes the whole budget (a first chunk of 40)
    engine.step()  # r0 ends its prompt; r1 waits for it; r2 gets in behind r1
    running = {seq.request_id for seq in engine.scheduler.running}
    waiting = [seq.request_id for seq in engine.scheduler.waiting]
    assert running == {"r0", "r2"} and waiting == ["r1"]
    while engine.has_unfinished():
        engine.step()


def test_prompts_shorter_than_a_block_never_wait():
    short = [([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0)) for _ in range(3)]
    tokens, runner, _ = run(make_config(), short)
    assert runner.num_computed_tokens == 3 * 3 + 3 * 1  # nothing shareable: all at once
    assert tokens[0] == tokens[1] == tokens[2]
