"""Small builders for engine-core tests: tiny pools and blocks so edge cases come quickly."""

from __future__ import annotations

import dataclasses
import itertools

from zeroserve.worker.block_manager import BlockManager
from zeroserve.worker.config import EngineConfig
from zeroserve.worker.engine import Engine
from zeroserve.worker.fake_runner import FakeRunner
from zeroserve.worker.plan import SchedulerOutput
from zeroserve.worker.scheduler import Scheduler
from zeroserve.worker.sequence import SamplingParams, Sequence

_request_ids = itertools.count()


def make_config(**overrides) -> EngineConfig:
    fields = dict(
        block_size=4,
        num_kv_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=256,
    )
    fields.update(overrides)
    return EngineConfig(**fields)


def make_params(**overrides) -> SamplingParams:
    fields = dict(max_tokens=8, temperature=0.0)
    fields.update(overrides)
    return SamplingParams(**fields)


def prompt(num_tokens: int, start: int = 100) -> list[int]:
    """Distinct token ids, so different starts give different blocks."""
    return list(range(start, start + num_tokens))


def make_seq(
    num_prompt_tokens: int = 10,
    *,
    prompt_token_ids: list[int] | None = None,
    request_id: str | None = None,
    **params,
) -> Sequence:
    tokens = prompt(num_prompt_tokens) if prompt_token_ids is None else prompt_token_ids
    request_id = f"req-{next(_request_ids)}" if request_id is None else request_id
    return Sequence(request_id, list(tokens), make_params(**params))


def make_block_manager(num_blocks: int = 16, block_size: int = 4, **kwargs) -> BlockManager:
    return BlockManager(num_blocks, block_size, **kwargs)


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    clock: FakeClock | None = None, **config_overrides
) -> tuple[Scheduler, FakeRunner]:
    """A scheduler and a FakeRunner on the same config; the runner checks every plan."""
    config = make_config(**config_overrides)
    runner = FakeRunner(config)
    block_manager = BlockManager(
        runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
    )
    scheduler = Scheduler(
        config,
        block_manager,
        max_model_len=runner.info.max_model_len,
        eos_token_ids=runner.info.eos_token_ids,
        clock=clock or FakeClock(),
    )
    return scheduler, runner


def run_step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Sequence]]:
    """One step: the plan as it ran, and the sequences update() changed."""
    plan = scheduler.schedule()
    sampled = runner.execute(plan) if not plan.is_empty else []
    ran = snapshot(plan)
    return ran, scheduler.update(plan, sampled)


def snapshot(plan: SchedulerOutput) -> SchedulerOutput:
    """A copy of plan as it is now: update() spends a plan, moving the chunks that sampled
    on to the next step's decodes (worker/plan.py)."""
    return SchedulerOutput([dataclasses.replace(c) for c in plan.chunks], list(plan.preempted))


def make_engine(runner_kwargs: dict | None = None, **config_overrides) -> Engine:
    config = make_config(**config_overrides)
    return Engine(config, FakeRunner(config, **(runner_kwargs or {})))


def run_to_completion(engine: Engine, max_steps: int = 10_000) -> dict[str, list]:
    """Step until idle; every request's emitted tokens and its finish outputs."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.is_finished:
                finished.setdefault(output.request_id, []).append(output)
    else:
        raise AssertionError("engine did not finish")
    return {"tokens": tokens, "finished": finished}
