"""The OpenAI Agents SDK's default model (the Responses API) running a tool loop against a
live gateway: the agent calls the tool, sends its output back, and ends with the answer."""

from __future__ import annotations

import pytest

from tests.gateway.helpers import GatewayServer
from tests.gateway.http.test_responses import agent_reply, prompt_text

agents = pytest.importorskip("agents")


def test_agents_sdk_runs_a_tool_loop():
    from openai import AsyncOpenAI

    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        calls.append(city)
        return "sunny, 24C"

    agents.set_tracing_disabled(True)
    with GatewayServer(reasoning_parser="qwen3") as gw:
        worker = gw.worker(reply=agent_reply).start()
        assert worker.ready.wait(5)
        client = AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        model = agents.OpenAIResponsesModel(model="SmolLM2-135M-Instruct",
                                            openai_client=client)
        agent = agents.Agent(name="weather", instructions="Answer with the tool's help.",
                             tools=[get_weather], model=model)
        result = agents.Runner.run_sync(agent, "Weather in Paris?")
        worker.stop()
    assert calls == ["Paris"]
    assert result.final_output == "Sunny in Paris."
    last_prompt = prompt_text(worker.submits[-1].prompt_token_ids)
    assert "sunny, 24C" in last_prompt and "Answer with the tool's help." in last_prompt
