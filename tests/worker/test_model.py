"""The model and runner on a tiny random Llama: paged vs unpaged, chunked vs whole prefill,
preemption, and the runner's contract (one token per sampling chunk, in order)."""

from __future__ import annotations

import pytest
import torch

from zeroserve.worker.config import EngineConfig
from zeroserve.worker.model_runner import ModelRunner
from zeroserve.worker.plan import ScheduledChunk, SchedulerOutput
from zeroserve.worker.sequence import SamplingParams

PROMPTS = [
    [1, 5, 9, 200, 17],
    [1, 44],
    [1, 3, 3, 3, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    [1, 100, 101, 102, 103, 104, 105, 106, 107],
    [7],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module", params=[
    ("cpu", "torch"), ("cpu", "native"), pytest.param(("cuda", "torch"), marks=pytest.mark.cuda),
], ids=lambda p: "-".join(p))
def runner(tiny_hf_dir, request):
    """Every runner test runs with both CPU decode attention backends, and on CUDA."""
    device, backend = request.param
    return ModelRunner(EngineConfig(model=str(tiny_hf_dir), device=device, dtype="float32",
                                    block_size=4, num_kv_blocks=128, attention_backend=backend))


def unpaged_greedy(runner: ModelRunner, prompt: list[int], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(num_tokens):
            tokens.append(int(runner.model.forward_unpaged(tokens)[-1].argmax()))
    return tokens[len(prompt):]


def test_paged_batch_matches_unpaged_reference(runner, hand_loop):
    expected = [unpaged_greedy(runner, p, 24) for p in PROMPTS]
    assert hand_loop(runner).generate(PROMPTS, 24) == expected
    # The outputs are not degenerate: sequences differ and tokens vary.
    assert len({tuple(e) for e in expected}) == len(PROMPTS)
    assert all(len(set(e)) > 3 for e in expected)


def test_chunked_prefill_matches_whole_prefill(runner, hand_loop):
    whole = hand_loop(runner).generate(PROMPTS, 16)
    for chunk_size in (1, 3, 8):
        assert hand_loop(runner, seed=chunk_size).generate(PROMPTS, 16, chunk_size=chunk_size) == whole


def test_preempted_sequences_resume_with_identical_tokens(runner, hand_loop):
    whole = hand_loop(runner).generate(PROMPTS, 20)
    preempt = {3: ["0", "2"], 7: ["1"], 12: ["0", "3", "4"]}
    assert hand_loop(runner, seed=5).generate(PROMPTS, 20, preempt=preempt, chunk_size=4) == whole


def test_one_sampled_token_per_sampling_chunk_in_order(runner):
    chunks = [
        ScheduledChunk("b", [5, 6, 7], 0, [0], True, GREEDY),
        ScheduledChunk("a", [9, 9, 9, 9, 9], 0, [1, 2], False, GREEDY),  # mid-prefill
        ScheduledChunk("c", [11], 0, [3], True, GREEDY),
    ]
    sampled = runner.execute(SchedulerOutput(chunks))
    assert [s.request_id for s in sampled] == ["b", "c"]
    assert all(0 <= s.token_id < runner.info.vocab_size for s in sampled)
    timing = runner.last_timing
    assert timing.forward_s > 0 and timing.prepare_s > 0 and timing.num_tokens == 9
    assert runner.execute(SchedulerOutput([])) == []


def test_same_prompt_in_one_batch_gives_same_tokens(runner, hand_loop):
    out = hand_loop(runner).generate([PROMPTS[0]] * 4 + [PROMPTS[2]], 12)
    assert out[0] == out[1] == out[2] == out[3]


def test_kv_pool_layout_and_sizing(tiny_hf_dir):
    runner = ModelRunner(EngineConfig(model=str(tiny_hf_dir), dtype="float32", block_size=8,
                                      num_kv_blocks=10))
    assert runner.num_kv_blocks == 10 and runner.block_size == 8
    assert len(runner.kv_caches) == runner.info.num_layers == 2
    k, v = runner.kv_caches[0]
    assert k.shape == v.shape == (10, 8, 2, 16)
    # 2 (K,V) x 2 layers x 8 tokens x 2 heads x 16 dims x 4 bytes
    by_memory = ModelRunner(EngineConfig(model=str(tiny_hf_dir), dtype="float32", block_size=8,
                                         kv_cache_memory=4096 * 7 + 100))
    assert by_memory.num_kv_blocks == 7
    capped = ModelRunner(EngineConfig(model=str(tiny_hf_dir), dtype="float32", block_size=16,
                                      max_num_seqs=2, max_model_len=64))
    assert capped.info.max_model_len == 64
    assert capped.num_kv_blocks == 2 * 64 // 16  # nothing beyond what 2 full sequences use


def test_max_model_len_is_capped_by_the_model(tiny_hf_dir):
    runner = ModelRunner(EngineConfig(model=str(tiny_hf_dir), dtype="float32",
                                      max_model_len=100_000, num_kv_blocks=4))
    assert runner.info.max_model_len == 512


def test_bfloat16_runner_agrees_with_float32(tiny_hf_dir, hand_loop):
    fp32 = ModelRunner(EngineConfig(model=str(tiny_hf_dir), dtype="float32", num_kv_blocks=64))
    bf16 = ModelRunner(EngineConfig(model=str(tiny_hf_dir), dtype="bfloat16", num_kv_blocks=64))
    assert bf16.info.dtype == "bfloat16" and bf16.kv_caches[0][0].dtype == torch.bfloat16
    with torch.inference_mode():
        a = fp32.model.forward_unpaged(PROMPTS[2])
        b = bf16.model.forward_unpaged(PROMPTS[2])
    assert b.dtype == torch.float32  # logits are always handed to the sampler in fp32
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.99
    # The paged bf16 path runs and produces in-vocabulary tokens.
    out = hand_loop(bf16).generate(PROMPTS, 8)
    assert all(len(o) == 8 and all(0 <= t < 256 for t in o) for o in out)


def test_native_and_torch_decode_agree_in_bfloat16(tmp_path):
    """bf16 with head_dim 64 takes the kernel's AVX-512 path where the CPU has it: after the
    same prefill, a decode step's logits match the torch path's to bf16 precision."""
    from tests.worker.conftest import make_tiny_hf_model, save_hf_dir

    model_dir = save_hf_dir(make_tiny_hf_model(seed=1, hidden_size=256, head_dim=64,
                                               num_attention_heads=4, num_key_value_heads=2),
                            tmp_path / "hd64")
    prefill = [ScheduledChunk(str(i), p, 0, list(range(8 * i, 8 * i + 8)), True, GREEDY)
               for i, p in enumerate(PROMPTS)]
    decode = [ScheduledChunk(c.request_id, [7], len(c.token_ids), c.block_table, True, GREEDY)
              for c in prefill]
    logits = []
    for backend in ("torch", "native"):
        runner = ModelRunner(EngineConfig(model=str(model_dir), device="cpu", dtype="bfloat16",
                                          num_kv_blocks=64, attention_backend=backend))
        assert (runner.decode_kernel is not None) == (backend == "native")
        with torch.inference_mode():
            runner.execute(SchedulerOutput(prefill))  # fills the pool
            inputs = runner._prepare(decode)
            hidden = runner.model.forward(inputs.input_ids, inputs.positions, inputs.meta,
                                          runner.kv_caches)
            logits.append(runner.model.compute_logits(hidden))
    cos = torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=-1)
    assert cos.min() > 0.999


def test_native_backend_is_refused_where_it_cannot_run(tiny_hf_dir):
    with pytest.raises(ValueError, match="native attention kernel"):
        ModelRunner(EngineConfig(model=str(tiny_hf_dir), dtype="float16", num_kv_blocks=8,
                                 attention_backend="native"))
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


def test_decode_rows_group_by_context_length_only_when_it_pays():
    from zeroserve.worker.model_runner import group_by_length

    assert group_by_length([], 16) == []
    assert group_by_length([100] * 8, 16) == [(0, 8)]
    # 30 short contexts padded to one long one would waste ~30 x 1900 slots: split them off.
    assert group_by_length([50] * 30 + [2000, 2000], 16) == [(0, 30), (30, 32)]
    # Small differences are not worth another group.
    assert group_by_length([100, 120, 140, 160], 16) == [(0, 4)]
    groups = group_by_length([10] * 10 + [600] * 10 + [1500] * 10 + [3000] * 10, 16)
    assert groups == [(0, 10), (10, 20), (20, 30), (30, 40)]


def test_grouped_decode_matches_unpaged_reference(runner, hand_loop, monkeypatch):
    import zeroserve.worker.model_runner as model_runner

    monkeypatch.setattr(model_runner, "MIN_GROUP_SAVED_SLOTS", 0)
    monkeypatch.setattr(model_runner, "MIN_GROUP_SAVING", 0.0)
    prompts = [PROMPTS[4], PROMPTS[2] * 3, PROMPTS[1], PROMPTS[3] * 2, PROMPTS[0]]
    expected = [unpaged_greedy(runner, p, 10) for p in prompts]
    assert hand_loop(runner).generate(prompts, 10) == expected


def test_a_resumed_stream_continues_exactly_on_the_real_model(tiny_hf_dir):
    """Failover on fp32 numerics: prompt + the tokens so far, prefilled on a fresh engine,
    give the same tokens an undisturbed run gives (seeded sampling is stateless by (seed, n))."""
    from zeroserve.worker.engine import Engine
    from zeroserve.worker.sequence import SamplingParams

    def engine() -> Engine:
        return Engine(EngineConfig(model=str(tiny_hf_dir), device="cpu", dtype="float32",
                                   num_kv_blocks=64, block_size=8))

    params = SamplingParams(max_tokens=20, temperature=0.8, seed=3)
    prompt_ids = [5, 17, 99, 23, 41, 7]
    full = engine().generate([prompt_ids], params)[0]
    resumed = engine()
    resumed.add_request("r", prompt_ids, params, output_token_ids=full[:7])
    rest = []
    while resumed.has_unfinished():
        rest += [t for o in resumed.step() for t in o.new_token_ids]
    assert rest == full[7:]
