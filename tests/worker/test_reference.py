"""zeroserve against a reference no one here wrote: Hugging Face transformers loading the same
GGUF file, fp32, greedy. Same tokens for 20 varied prompts x 64 tokens, one at a time and all
batched together with mixed lengths (through the Engine: scheduler, paging, chunked prefill),
with the engine on the CPU and, where there is one, on a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from tests.worker.conftest import default_reference_tokenizer, encode_prompts
from zeroserve.worker.config import EngineConfig
from zeroserve.worker.engine import Engine
from zeroserve.worker.sequence import SamplingParams

pytestmark = pytest.mark.slow

NUM_TOKENS = 64
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "The quick brown fox",
    "import numpy as np\nx = np.",
    "Photosynthesis is the process by which",
    "Dear hiring manager, I am writing to apply for",
    "The three primary colors are",
    "SELECT name, age FROM users WHERE",
    "In 1969, Neil Armstrong",
    "Translate to French: Good morning, how are you?",
    "A list of healthy breakfast ideas:\n1.",
    "The mitochondria is",
    "Roses are red, violets are blue,",
    "To make a cup of tea, first",
    "The largest planet in our solar system",
]
CHATS = [
    "What is 12 times 7?",
    "Write a haiku about autumn leaves.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return default_reference_tokenizer()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = encode_prompts(tokenizer, TEXTS, CHATS)
    assert len(ids) == 20 and len({len(p) for p in ids}) > 8  # mixed lengths
    return ids


@pytest.fixture(scope="module")
def hf_tokens(prompts, tokenizer, hf_reference_model) -> list[list[int]]:
    model = hf_reference_model
    eos = tokenizer.eos_token_id
    out = []
    # Unpadded, a few at a time of equal length would be faster, but left padding changes
    # nothing in greedy results of a correct reference; batch all for speed.
    batch = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**batch, max_new_tokens=NUM_TOKENS, do_sample=False,
                                   pad_token_id=eos)
    for row in generated[:, batch["input_ids"].shape[1]:].tolist():
        out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def engine(request) -> Engine:
    return Engine(EngineConfig(device=request.param, dtype="float32", num_kv_blocks=512,
                               max_num_batched_tokens=256, max_model_len=1024))


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)


def test_batched_greedy_matches_transformers(engine, prompts, hf_tokens):
    ours = engine.generate(prompts, GREEDY)
    mismatches = [i for i, (a, b) in enumerate(zip(ours, hf_tokens, strict=True)) if a != b]
    assert not mismatches, [(i, ours[i], hf_tokens[i]) for i in mismatches]
    assert sum(len(t) for t in ours) > 15 * NUM_TOKENS  # most ran the full length


def test_single_stream_greedy_matches_transformers(engine, prompts, hf_tokens):
    for i in range(0, len(prompts), 4):  # every 4th alone keeps the test short
        assert engine.generate([prompts[i]], GREEDY) == [hf_tokens[i]], i
