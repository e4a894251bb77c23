"""The fake runner's tokens and stamps: the benchmarks' backend must make the same tokens by
its short way (one loop, inlined) as by next_token, and record when each one was made."""

from __future__ import annotations

import atexit
import json
import random
import time

from tests.worker.factories import make_config, make_params
from zeroserve.worker.fake_runner import EOS_TOKEN_ID, VOCAB_SIZE, FakeRunner
from zeroserve.worker.plan import ScheduledChunk, SchedulerOutput


def _chunks(rng: random.Random, num: int) -> list[ScheduledChunk]:
    """Decodes, prefill chunks (some not sampling), seeds, logprobs and drafts, mixed."""
    chunks = []
    for i in range(num):
        prompt = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(1, 9))]
        outputs = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(0, 5))]
        known = prompt + outputs
        kind = rng.random()
        params = make_params(seed=rng.choice([None, 0, 7, 12345]),
                             logprobs=2 if kind < 0.15 else None)
        if kind > 0.9 and outputs:  # a decode with drafts
            drafts = [rng.randrange(3, VOCAB_SIZE) for _ in range(2)]
            chunks.append(ScheduledChunk(f"r{i}", [known[-1], *drafts], len(known) - 1, [0, 1],
                                         True, params, prompt, outputs, drafts))
            continue
        start = rng.randrange(0, len(known))
        end = rng.choice([len(known), rng.randrange(start + 1, len(known) + 1)])
        chunks.append(ScheduledChunk(f"r{i}", known[start:end], start, [0, 1, 2],
                                     end == len(known), params, prompt, outputs))
    return chunks


def test_the_short_way_makes_next_tokens_tokens():
    runner = FakeRunner(make_config(seed=3), check_plans=False)
    rng = random.Random(5)
    for _ in range(20):
        chunks = _chunks(rng, 50)
        expected = [runner._sample_drafted(c) if c.draft_token_ids else runner._sample(c)
                    for c in chunks if c.do_sample]
        assert runner._sample_all(chunks) == expected
    # The one token it never makes by itself: EOS becomes the next id.
    eos_chunk = next(c for c in (ScheduledChunk("e", [t], 0, [0], True, make_params(), [t])
                                 for t in range(VOCAB_SIZE))
                     if (c.token_ids[0] * 7919 + 3 * 31 + 17) % VOCAB_SIZE == EOS_TOKEN_ID)
    (token,) = runner._sample_all([eos_chunk])
    assert token.token_id == EOS_TOKEN_ID + 1 == runner.next_token(eos_chunk)


def test_stamps_record_every_sampled_token_when_its_device_time_ends(tmp_path):
    path = tmp_path / "stamps.json"
    runner = FakeRunner(make_config(), check_plans=False, forward_time_s=0.01,
                        stamps_path=str(path))
    atexit.unregister(runner._write_stamps)
    rng = random.Random(1)
    steps = []
    for _ in range(3):
        chunks = _chunks(rng, 20)
        before = time.monotonic()
        runner.execute(SchedulerOutput(chunks))
        steps.append((before, time.monotonic(), chunks))
    runner._write_stamps(str(path))
    stamps = json.loads(path.read_text())
    expected = [(c.prompt_token_ids[0], len(c.output_token_ids))
                for _, _, chunks in steps for c in chunks if c.do_sample]
    assert [(first, index) for first, index, _ in stamps] == expected
    k = 0
    for before, after, chunks in steps:
        for _ in (c for c in chunks if c.do_sample):
            assert before + 0.01 <= stamps[k][2] <= after + 1e-3
            k += 1
