"""The official `openai` client against `zeroserve serve` with the real default model.

Greedy output through the whole system (HTTP, gateway tokenizer and chat template, ZeroMQ,
worker, detokenizer, SSE) must equal what the in-process Engine generates for the same token
ids. Multi-byte characters split across tokens must stream without U+FFFD.
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import NUM_THREADS
from tests.e2e.helpers import MODEL

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

MAX_TOKENS = 6  # few: the real model on a shared 2-core CPU is slow


@pytest.fixture(scope="module")
def server(real_model_server):
    """The session's real-model server (tests/e2e/conftest.py: float32, deterministic on the
    CPU and verified to produce what the tests need, see the multi-byte test)."""
    return real_model_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def engine(server):
    """The in-process engine with the server worker's configuration (loaded after the
    server is up, so the two loads do not fight over the CPU)."""
    import torch

    from zeroserve.worker.config import EngineConfig
    from zeroserve.worker.engine import Engine

    num_threads = torch.get_num_threads()
    torch.set_num_threads(NUM_THREADS)  # the server worker's, for the same float sums
    yield Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=256, max_num_seqs=4))
    torch.set_num_threads(num_threads)  # the session's later tests run with all the cores


def engine_text(server, engine, prompt_ids: list[int], max_tokens: int) -> tuple[str, list[int]]:
    """Greedy tokens from the in-process engine, as text (the server's own detokenizer)."""
    from zeroserve.worker.sequence import SamplingParams

    [ids] = engine.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    content = [t for t in ids if t not in engine.info.eos_token_ids]
    text = httpx.post(server.url + "/detokenize", json={"tokens": content}).json()["prompt"]
    return text, ids


def tokenize(server, **body) -> list[int]:
    response = httpx.post(server.url + "/tokenize", json={"model": MODEL, **body})
    response.raise_for_status()
    return response.json()["tokens"]


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_default_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_greedy_matches_the_engine_streaming_or_not(server, client, engine):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                           max_tokens=MAX_TOKENS)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}))
    prompt_ids = tokenize(server, messages=MESSAGES)
    expected, ids = engine_text(server, engine, prompt_ids, MAX_TOKENS)

    assert reply.choices[0].message.content == expected
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == len(ids)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [reply.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == len(ids)


def test_responses_greedy_matches_chat_streaming_or_not(client):
    """/v1/responses runs as a chat completion: the same greedy text, in Responses shapes."""
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                          max_tokens=MAX_TOKENS)
    reply = client.responses.create(model=MODEL, input=MESSAGES, temperature=0,
                                    max_output_tokens=MAX_TOKENS)
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    with client.responses.stream(model=MODEL, input=MESSAGES, temperature=0,
                                 max_output_tokens=MAX_TOKENS) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert streamed == reply.output_text


def test_completion_greedy_matches_the_engine_streaming_or_not(server, client, engine):
    prompt = "The three primary colors are"
    reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                      max_tokens=MAX_TOKENS)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, stream=True))
    prompt_ids = tokenize(server, prompt=prompt)
    expected, _ = engine_text(server, engine, prompt_ids, MAX_TOKENS)
    assert reply.choices[0].text == expected
    assert streamed == expected


@pytest.mark.parametrize("prompt,max_tokens,must_contain", [
    # Greedy continuations (checked): " apple, 🍗" ends with a 4-byte emoji split over three
    # tokens; "！！" is a 3-byte full-width CJK mark split over two tokens, twice.
    ("Emoji list: 🍎 apple, 🍌 banana, 🍒 cherry, 🍇", 5, "🍗"),
    ("你好，世界！你好，世界！你好，世界！", 4, "！"),
])
def test_multi_byte_text_streams_whole_characters(server, client, engine, prompt, max_tokens,
                                                  must_contain):
    chunks = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=max_tokens, stream=True)]
    streamed = "".join(chunks)
    assert not any("\ufffd" in c for c in chunks)
    expected, _ = engine_text(server, engine, tokenize(server, prompt=prompt), max_tokens)
    assert streamed == expected
    assert must_contain in streamed
