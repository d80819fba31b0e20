"""A LangChain tool-calling loop (`langchain-openai`'s `ChatOpenAI`), unchanged, against a real `agentrt
serve` on the default model, pointed at it by base URL alone.

The loop is LangChain's own: `bind_tools` sends the tool's schema, the model's `AIMessage.tool_calls`
are run by the caller and sent back as `ToolMessage`s, and a second turn answers with the code that only
the tool's result holds. Invoked and streamed (chunks added up as LangChain does, tool-call chunks
included), and a typed answer through `with_structured_output` (json_schema). The first turn forces
the call (`tool_choice` naming the tool: SmolLM2-135M does not choose tools on its own), which the
server turns into a schema-valid call by constrained decoding; the tool's parameter is an enum.
"""

from __future__ import annotations

from typing import Literal

import pytest

from tests.conftest import requires_default_model

langchain_openai = pytest.importorskip("langchain_openai")
pytestmark = [requires_default_model, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
SECRET = "ZEBRA-4417"
QUESTION = "What is the access code of vault Orion? Use the lookup_code tool."


@pytest.fixture(scope="module")
def server():
    from agentrt.server import ServerConfig
    from tests.server.live import live_server

    with live_server(ServerConfig(engine={"num_blocks": 512}, db="none")) as s:
        yield s


def make_tool(calls: list[str]):
    from langchain_core.tools import tool

    @tool
    def lookup_code(vault: Literal["Orion", "Lyra", "Vega"]) -> str:
        """Look up the secret access code of a vault by its name."""
        calls.append(vault)
        return f"The access code of vault {vault} is {SECRET}."

    return lookup_code


def chat_model(server, **kw):
    return langchain_openai.ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0,
                                       max_tokens=48, max_retries=0, timeout=120, **kw)


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_langchain_tool_loop(server, stream):
    from langchain_core.messages import HumanMessage, SystemMessage

    calls: list[str] = []
    lookup = make_tool(calls)
    llm = chat_model(server, stream_usage=True)
    forced = llm.bind_tools([lookup], tool_choice="lookup_code")
    messages = [SystemMessage("Use the tools to find vault codes. Answer with the code."), HumanMessage(QUESTION)]

    if stream:
        first = None
        for chunk in forced.stream(messages):
            first = chunk if first is None else first + chunk
        assert first.usage_metadata["input_tokens"] > 0 and first.usage_metadata["output_tokens"] > 0
    else:
        first = forced.invoke(messages)
    assert [c["name"] for c in first.tool_calls] == ["lookup_code"] and first.tool_calls[0]["id"]
    assert first.tool_calls[0]["args"] == {"vault": "Orion"}
    messages += [first, lookup.invoke(first.tool_calls[0])]  # a ToolMessage with the call's id
    assert calls == ["Orion"]

    answer = llm.bind_tools([lookup]).invoke(messages)  # tool_choice left to the model ("auto")
    assert not answer.tool_calls and SECRET in answer.content
    server.wait_idle()


def test_langchain_structured_output(server):
    from pydantic import BaseModel

    class Vault(BaseModel):
        vault: Literal["Orion", "Lyra", "Vega"]
        code: str

    typed = chat_model(server).with_structured_output(Vault, method="json_schema")
    got = typed.invoke(f"The access code of vault Orion is {SECRET}. Give the vault and its code.")
    assert isinstance(got, Vault) and got.vault in ("Orion", "Lyra", "Vega") and got.code
    server.wait_idle()
