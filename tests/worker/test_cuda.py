"""The worker on a CUDA GPU: device and dtype choice, the runner against the CPU fp32
reference (a tiny random model, then the embedded default model), the sampler on the GPU, and
KV blocks and GPU memory coming back after requests. Skipped without CUDA (tests/conftest.py).
"""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.worker.test_model import PROMPTS
from zeroserve.worker.config import EngineConfig
from zeroserve.worker.device import dtype_name, resolve_device, resolve_dtype
from zeroserve.worker.engine import Engine
from zeroserve.worker.model_runner import ModelRunner
from zeroserve.worker.plan import ScheduledChunk
from zeroserve.worker.sampler import Sampler
from zeroserve.worker.sequence import SamplingParams

pytestmark = pytest.mark.cuda

CPU = torch.device("cpu")
GPU = torch.device("cuda:0")


def tiny_runner(model_dir, device: str, dtype: str = "float32", **overrides) -> ModelRunner:
    fields = dict(model=str(model_dir), device=device, dtype=dtype, block_size=4,
                  num_kv_blocks=128)
    return ModelRunner(EngineConfig(**{**fields, **overrides}))


def test_auto_picks_the_gpu_and_a_half_precision_dtype():
    assert resolve_device("auto") == GPU
    assert resolve_device("cuda") == GPU
    expected = torch.bfloat16 if torch.cuda.get_device_capability() >= (8, 0) else torch.float16
    assert resolve_dtype("auto", GPU) == expected


def test_runner_puts_weights_and_kv_pool_on_the_gpu(tiny_hf_dir):
    runner = tiny_runner(tiny_hf_dir, "cuda", dtype="auto")
    dtype = resolve_dtype("auto", GPU)
    assert runner.info.device == "cuda:0" and runner.info.dtype == dtype_name(dtype)
    assert runner.decode_kernel is None  # the native kernel is CPU-only
    k, v = runner.kv_caches[0]
    assert k.device == v.device == runner.model.embed.device == runner.model.lm_head.dense.device
    assert k.device.type == "cuda" and k.dtype == dtype
    with pytest.raises(ValueError, match="native attention kernel"):
        tiny_runner(tiny_hf_dir, "cuda", attention_backend="native")


def test_fp32_on_the_gpu_gives_the_cpu_tokens(tiny_hf_dir, hand_loop):
    cpu = tiny_runner(tiny_hf_dir, "cpu", attention_backend="torch")
    gpu = tiny_runner(tiny_hf_dir, "cuda")
    with torch.inference_mode():
        torch.testing.assert_close(gpu.model.forward_unpaged(PROMPTS[2]).cpu(),
                                   cpu.model.forward_unpaged(PROMPTS[2]), atol=1e-4, rtol=1e-4)
    expected = hand_loop(cpu).generate(PROMPTS, 24)
    assert hand_loop(gpu).generate(PROMPTS, 24) == expected
    # Chunked prefill and recompute preemption on the GPU change nothing either.
    preempt = {3: ["0", "2"], 9: ["1", "4"]}
    assert hand_loop(gpu, seed=3).generate(PROMPTS, 24, chunk_size=3, preempt=preempt) == expected


def test_bf16_on_the_gpu_tracks_fp32(tiny_hf_dir, hand_loop):
    fp32 = tiny_runner(tiny_hf_dir, "cpu", attention_backend="torch")
    bf16 = tiny_runner(tiny_hf_dir, "cuda", dtype="bfloat16")
    with torch.inference_mode():
        a = fp32.model.forward_unpaged(PROMPTS[2])
        b = bf16.model.forward_unpaged(PROMPTS[2])
    assert b.dtype == torch.float32 and b.device.type == "cuda"
    assert torch.nn.functional.cosine_similarity(a, b.cpu(), dim=-1).min() > 0.99
    out = hand_loop(bf16).generate(PROMPTS, 8)
    assert all(len(o) == 8 and all(0 <= t < 256 for t in o) for o in out)


def sampling_chunks() -> list[ScheduledChunk]:
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=1.0, top_k=20, seed=12),
        SamplingParams(temperature=1.2, top_p=0.9, seed=13, logprobs=2),
        SamplingParams(temperature=0.7, min_p=0.05, seed=14),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5,
                       presence_penalty=0.2, seed=15),
        SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=[7], seed=16),
    ]
    return [ScheduledChunk(str(i), [1], 0, [0], True, p, [5, 6, 7, 8], [9, 9, 10])
            for i, p in enumerate(params)]


def test_sampler_on_the_gpu_draws_what_the_cpu_draws():
    """Uniforms come from CPU generators, so seeded requests get the same tokens on either
    device (given the same logits), and greedy rows the exact argmax."""
    vocab = 1000
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(0)) * 3
    chunks = sampling_chunks()
    for _ in range(3):  # a few draws, so the shared generators advance alike
        on_cpu = Sampler(vocab, [2], CPU, seed=0).sample(logits.clone(), chunks)
        on_gpu = Sampler(vocab, [2], GPU, seed=0).sample(logits.to(GPU), chunks)
        assert [t.token_id for t in on_gpu] == [t.token_id for t in on_cpu]
        assert on_gpu[0].token_id == int(logits[0].argmax())
        for a, b in zip(on_gpu, on_cpu, strict=True):
            assert (a.logprob is None) == (b.logprob is None)
            if a.logprob is not None:
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        logits = logits.roll(1, dims=1)


def test_kv_blocks_and_gpu_memory_come_back_after_requests(tiny_hf_dir):
    """A pool small enough to force preemption: every block is free again afterwards, the
    tokens equal the CPU engine's, and a second identical run leaves no more GPU memory
    allocated than the first (nothing per request or per step is kept on the device)."""
    config = dict(model=str(tiny_hf_dir), dtype="float32", block_size=4, num_kv_blocks=24,
                  max_num_seqs=6, max_num_batched_tokens=32, max_model_len=96)
    prompts = [p * 2 for p in PROMPTS] + PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    gpu = Engine(EngineConfig(device="cuda", **config))
    cpu = Engine(EngineConfig(device="cpu", attention_backend="torch", **config))
    total = gpu.block_manager.num_total_blocks
    first = gpu.generate(prompts, params)
    assert gpu.block_manager.num_free_blocks == total
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    assert gpu.generate(prompts, params) == first == cpu.generate(prompts, params)
    assert gpu.block_manager.num_free_blocks == total
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated


# ---- the embedded default model (SmolLM2-135M, Q4_1 GGUF) ----

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Photosynthesis is the process by which",
    "SELECT name, age FROM users WHERE",
    "To make a cup of tea, first",
]


@pytest.fixture(scope="module")
def default_prompts() -> list[list[int]]:
    from zeroserve.gateway.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("default")
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.mark.slow
def test_default_model_fp32_on_the_gpu_gives_the_cpu_tokens(default_prompts):
    config = dict(dtype="float32", num_kv_blocks=256, max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    on_cpu = Engine(EngineConfig(device="cpu", **config)).generate(default_prompts, params)
    gpu = Engine(EngineConfig(device="cuda", **config))
    assert gpu.generate(default_prompts, params) == on_cpu
    assert gpu.block_manager.num_free_blocks == gpu.block_manager.num_total_blocks


@pytest.mark.slow
def test_default_model_bf16_on_the_gpu_tracks_fp32(default_prompts):
    """bf16 rounds differently, so long greedy runs may part ways; the next-token choice at
    every prompt position should still agree almost everywhere."""
    fp32 = ModelRunner(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=16))
    bf16 = ModelRunner(EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=16))
    agree = total = 0
    with torch.inference_mode():
        for prompt in default_prompts:
            a = fp32.model.forward_unpaged(prompt)
            b = bf16.model.forward_unpaged(prompt).cpu()
            assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.98
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += len(prompt)
    assert agree / total > 0.85, f"top-1 agreement {agree}/{total}"


@pytest.mark.slow
def test_serve_on_the_gpu_answers_a_chat_completion(zeroserve):
    server = zeroserve(args=("--device", "cuda", "--max-num-seqs", "8"), timeout_s=240)
    [worker] = server.ready_workers()
    assert worker["device"] == "cuda:0"
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "What is 12 times 7?"}]}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["usage"]["completion_tokens"] == 16
    assert reply["choices"][0]["message"]["content"].strip()
