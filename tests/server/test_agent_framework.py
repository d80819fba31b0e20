"""A tool-using agent written with the OpenAI Agents SDK (`openai-agents`), unchanged, against a real
`agentrt serve` on the default model, pointed at it by base URL alone.

The task needs the tool: the vault's access code exists only in the tool's result, and the agent's
final answer must carry it. Each run goes the whole agent loop: a model turn that calls the tool, the
SDK runs it and sends the result back, a second model turn that answers. Over both of the SDK's
model APIs (Responses, the SDK's default, and chat completions), streamed (`Runner.run_streamed`) and
not, with a plain-text answer and with a typed one (`output_type`, sent as `text.format` /
`response_format` json_schema). On the Responses API the second turn sends only the tool result and
`previous_response_id` (`auto_previous_response_id`), so the server's stored chain carries the rest.

Why the knobs: SmolLM2-135M does not decide on its own to call a tool (with the SDK's default
`tool_choice="auto"` it answers in prose and makes a code up), so the agent sets what any user of the
SDK can: `ModelSettings(tool_choice="required")`, which the server turns into a schema-valid call by
constrained decoding; the SDK resets it to "auto" after the call (`reset_tool_choice`), so the second
turn may answer. The tool's parameter is a `Literal` (an enum in its schema), so the forced call
cannot ramble in a free string; `temperature=0` makes the run repeatable, `max_tokens` bounds it.
Tracing is off: the SDK would otherwise try to upload traces to OpenAI.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest

from tests.conftest import requires_default_model

agents = pytest.importorskip("agents")
pytestmark = [requires_default_model, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
SECRET = "ZEBRA-4417"
QUESTION = "What is the access code of vault Orion?"


@pytest.fixture(scope="module")
def server():
    from agentrt.server import ServerConfig
    from tests.server.live import live_server

    agents.set_tracing_disabled(True)
    with live_server(ServerConfig(engine={"num_blocks": 512}, db="none")) as s:
        yield s


def make_agent(base_url: str, api: str, typed: bool, calls: list[str]):
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    @agents.function_tool
    def lookup_code(vault: Literal["Orion", "Lyra", "Vega"]) -> str:
        """Look up the secret access code of a vault by its name."""
        calls.append(vault)
        return f"The access code of vault {vault} is {SECRET}."

    class Answer(BaseModel):
        vault: str
        code: str

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused")
    cls = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
    return agents.Agent(
        name="vault keeper",
        instructions="Use the lookup_code tool to find vault codes. Answer with the code.",
        tools=[lookup_code],
        model=cls(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
        output_type=Answer if typed else None,
    )


async def run_agent(agent, api: str, stream: bool):
    kw = {"max_turns": 3, "auto_previous_response_id": api == "responses"}
    if not stream:
        return await agents.Runner.run(agent, QUESTION, **kw)
    result = agents.Runner.run_streamed(agent, QUESTION, **kw)
    kinds = set()
    async for ev in result.stream_events():
        kinds.add(ev.type)
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    return result


@pytest.mark.parametrize("typed", [False, True], ids=["text", "typed"])
@pytest.mark.parametrize("stream", [False, True], ids=["run", "streamed"])
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_agent_finishes_a_task_that_needs_its_tool(server, api, stream, typed):
    calls: list[str] = []
    agent = make_agent(server.url, api, typed, calls)
    result = asyncio.run(run_agent(agent, api, stream))

    assert calls == ["Orion"]
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    if typed:
        assert result.final_output.code == SECRET
    else:
        assert SECRET in result.final_output
    server.wait_idle()
