"""Prompt logprobs (OpenAI's echo + logprobs, vLLM's prompt_logprobs): each prompt token's
logprob given the tokens before it, equal to transformers' on the same tiny model in fp32,
whether the prompt is computed in one chunk or several, and never served from the prefix
cache (which holds K/V, not logits)."""

from __future__ import annotations

import pytest
import torch

from zeroserve.worker.config import EngineConfig
from zeroserve.worker.engine import Engine
from zeroserve.worker.sequence import SamplingParams

PROMPT = [1, 17, 200, 45, 45, 9, 120, 33, 250, 7, 77, 3, 5, 180, 64, 99, 12, 140, 8, 31, 2]


def reference(model, prompt: list[int], k: int) -> list[tuple[float, list[int]]]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    return [(float(c), torch.topk(row, k).indices.tolist())
            for c, row in zip(chosen, logprobs, strict=True)]


def run(engine: Engine, request_id: str, params: SamplingParams) -> tuple[list, list[int]]:
    engine.add_request(request_id, PROMPT, params)
    prompt_logprobs, tokens = None, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            if out.prompt_logprobs is not None:
                assert prompt_logprobs is None  # handed out once
                prompt_logprobs = out.prompt_logprobs
    return prompt_logprobs, tokens


@pytest.mark.parametrize("chunk", [64, 5])
def test_prompt_logprobs_equal_transformers(tiny_hf_model, tiny_hf_dir, chunk):
    engine = Engine(EngineConfig(model=str(tiny_hf_dir), dtype="float32", device="cpu",
                                 block_size=4, num_kv_blocks=64, max_num_batched_tokens=chunk))
    expected = reference(tiny_hf_model, PROMPT, 3)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    for attempt in range(2):  # the second time its blocks are cached: still computed
        got, tokens = run(engine, f"r{attempt}", params)
        assert len(got) == len(PROMPT) - 1 and len(tokens) == 2
        for (lp, top), (ref_lp, ref_top) in zip(got, expected, strict=True):
            assert lp == pytest.approx(ref_lp, abs=1e-4)
            assert [t for t, _ in top] == ref_top
    got, _ = run(engine, "plain", SamplingParams(max_tokens=1, temperature=0.0))
    assert got is None
    got, _ = run(engine, "zero", SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert [top for _, top in got] == [[]] * (len(PROMPT) - 1)
