"""The Anthropic Messages API through real processes (`zeroserve serve --backend fake`): the
anthropic SDK, and Claude Code where it is installed (`npm i -g @anthropic-ai/claude-code`).
The fake backend never writes EOS, so every answer ends at max_tokens."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS_LIMIT = 64


@pytest.fixture(scope="module")
def server(module_servers):
    return module_servers(args=("--backend", "fake", "--max-model-len", "65536",
                                "--max-tokens-limit", str(MAX_TOKENS_LIMIT)))


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key="sk-e2e", max_retries=0) as c:
        yield c


def test_sdk_create_stream_and_count_tokens(client):
    messages = [{"role": "user", "content": "Hello"}]
    message = client.messages.create(model=MODEL, max_tokens=8000, messages=messages)
    assert message.stop_reason == "max_tokens"  # lowered to the server's limit
    assert message.usage.output_tokens == MAX_TOKENS_LIMIT
    with client.messages.stream(model="claude-opus-4-8", max_tokens=10,
                                messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.model == MODEL and final.content[0].text == text
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 10)
    counted = client.messages.count_tokens(model=MODEL, messages=messages)
    assert counted.input_tokens == message.usage.input_tokens + \
        message.usage.cache_read_input_tokens


@pytest.mark.skipif(shutil.which("claude") is None, reason="Claude Code is not installed")
def test_claude_code_talks_to_the_server(server, tmp_path):
    """`claude -p` with only ANTHROPIC_BASE_URL and a key: its ~20k-token system prompt and
    two dozen tools are served (each answer ends at max_tokens with the fake backend, and
    Claude Code gives up after asking it to go on a few times)."""
    env = {**os.environ, "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "sk-e2e",
           "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "HOME": str(tmp_path)}
    done = subprocess.run(["claude", "-p", "hello", "--output-format", "stream-json",
                           "--verbose"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    answers = [e["message"] for e in events if e.get("type") == "assistant"
               and e["message"].get("model") == MODEL]
    assert answers, done.stdout[-2000:] + done.stderr[-2000:]
    assert answers[0]["usage"]["input_tokens"] > 10_000  # its system prompt and tools
    assert answers[0]["content"][0]["type"] == "text"
    result = next(e for e in events if e.get("type") == "result")
    assert "API Error: 4" not in str(result.get("result")), result
