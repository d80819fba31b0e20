"""A tool loop on a gpt-oss-shaped tiny checkpoint served with gpt-oss's real chat template
(tests/server/data/templates/gpt-oss.jinja: OpenAI's chat_template.jinja of gpt-oss-120b, as llama.cpp
vendors it in models/templates/openai-gpt-oss-120b.jinja), driven by the official `openai` client and by
the Agents SDK, with no parser flag: the server picks harmony (`openai`) from the template.

The checkpoint is transformers' GptOssForCausalLM (2 layers, 4 experts, a window of 8) when the engine
serves gpt_oss, else a tiny Llama, on the default model's tokenizer with harmony's special tokens added
(`<|start|>` ... `<|constrain|>`, special as in gpt-oss's own tokenizer, `<|return|>` and `<|call|>` its
stop tokens). Random weights write no harmony, so each turn's output is held by a regex
(`structured_outputs`) to what gpt-oss writes: thinking in the analysis channel, then a call addressed
`to=functions.get_weather`, or, once the tool has answered, a final answer. The calls must come back as
calls, the thinking as `reasoning_content`, the answer alone as content, the same streamed and not, and
the next prompt must hold the call and its result as the template renders them."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import openai
import pytest

from tests.agentrt.test_toolparsers import literal
from tests.server.conftest import check_idle
from tests.server.live import live_server, tiny_config

TEMPLATE = (Path(__file__).parent / "data" / "templates" / "gpt-oss.jinja").read_text()
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]
MARKUP = ("<|", "|>", "to=functions", "<tool_call>")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
THOUGHT = "The user wants the weather in Paris. Call get_weather."
CALL = (f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')
ANSWER = "It is 18 °C and sunny in Paris."
FINAL = f"<|channel|>analysis<|message|>The tool answered.<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"


def make_gpt_oss_shaped(path: Path) -> Path:
    import torch
    from transformers import GenerationConfig

    from agentrt.engine.loader import SUPPORTED_MODEL_TYPES, load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(os.environ.get("AGENTRT_TEST_TOKENIZER")))
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = TEMPLATE
    stops = tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    torch.manual_seed(0)
    if "gpt_oss" in SUPPORTED_MODEL_TYPES:
        from transformers import GptOssConfig, GptOssForCausalLM

        model = GptOssForCausalLM(GptOssConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096, rope_scaling=None,
            tie_word_embeddings=False, eos_token_id=stops[0]))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, eos_token_id=stops[0]))
    model.generation_config = GenerationConfig(eos_token_id=stops)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = make_gpt_oss_shaped(tmp_path_factory.mktemp("gpt-oss-tiny"))
    with live_server(tiny_config(path, served_model_name="gpt-oss-tiny")) as s:
        yield s
        check_idle(s)


def forced(output: str) -> dict:
    return {"structured_outputs": {"regex": literal(output)}, "return_token_ids": True}


def chat(client, messages, output: str, stream: bool) -> tuple[dict, str, list[int]]:
    """(the message as a client builds it, the finish reason, the prompt's token ids)."""
    kw = {"model": "gpt-oss-tiny", "messages": messages, "tools": [WEATHER], "temperature": 0, "max_tokens": 200,
          "extra_body": forced(output)}
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for c in m.tool_calls or []]
        return ({"role": "assistant", "content": m.content, "tool_calls": calls,
                 "reasoning": m.model_extra.get("reasoning_content")}, r.choices[0].finish_reason, r.prompt_token_ids)
    content, reasoning, calls, reason, prompt = [], [], [], None, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        prompt = prompt or chunk.model_extra.get("prompt_token_ids")
        for ch in chunk.choices:
            d = ch.delta
            if d.content:
                assert not any(m in d.content for m in MARKUP), d.content  # no markup ever shows
                content.append(d.content)
            reasoning.append((d.model_extra or {}).get("reasoning_content") or "")
            for c in d.tool_calls or []:
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}})
            reason = ch.finish_reason or reason
    return ({"role": "assistant", "content": "".join(content) or None, "tool_calls": calls,
             "reasoning": "".join(reasoning) or None}, reason, prompt)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_client_tool_loop(srv, client, stream):
    tok = srv.state.runtime.tokenizer
    first, reason, _ = chat(client, ASK, CALL, stream)
    assert reason == "tool_calls"
    assert first["content"] is None and first["reasoning"] == THOUGHT
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in first["tool_calls"]] == \
        [("get_weather", {"city": "Paris"})]
    call_id = first["tool_calls"][0]["id"]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": first["tool_calls"]},
               {"role": "tool", "tool_call_id": call_id, "content": "18 °C, sunny"}]
    second, reason, prompt = chat(client, history, FINAL, stream)
    assert (second["content"], second["tool_calls"], reason) == (ANSWER, [], "stop")
    assert second["reasoning"] == "The tool answered."
    text = tok.decode(prompt)
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 °C, sunny"<|end|>') in text
    assert text.endswith("<|start|>assistant") and "namespace functions" in text  # the tools, as the template writes them
    assert text == tok.apply_chat_template([*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        history[2] | {"name": "get_weather"}], tools=[WEATHER], tokenize=False, add_generation_prompt=True)


def test_harmony_special_tokens_are_real_tokens(srv):
    """The template's markup goes into the prompt as the special tokens themselves (one id each)."""
    tok = srv.state.runtime.tokenizer
    ids = tok("<|start|>assistant<|channel|>final<|message|>", add_special_tokens=False)["input_ids"]
    specials = [t for t in tok.convert_ids_to_tokens(ids) if t in HARMONY_TOKENS]
    assert specials == ["<|start|>", "<|channel|>", "<|message|>"] and set(tok.all_special_tokens) >= set(HARMONY_TOKENS)


class Script(httpx.AsyncBaseTransport):
    """The turn's output for the tiny model: a call until the tool has answered, then the answer; the SDK's
    requests otherwise go to the server as it sent them."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.bodies: list[dict] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(await request.aread())
        self.bodies.append(body)
        answered = body["messages"][-1]["role"] == "tool"
        body.update(forced(FINAL if answered else CALL))
        headers = [(k, v) for k, v in request.headers.items() if k.lower() != "content-length"]
        return await self.inner.handle_async_request(
            httpx.Request(request.method, request.url, headers=headers, content=json.dumps(body).encode()))

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("stream", [False, True], ids=["run", "streamed"])
def test_agents_sdk_tool_loop(srv, stream):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return "18 °C, sunny"

    async def main():
        script = Script()
        async with httpx.AsyncClient(transport=script, timeout=120) as http:
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", http_client=http, max_retries=0)
            agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                                 model=agents.OpenAIChatCompletionsModel(model="gpt-oss-tiny", openai_client=client),
                                 model_settings=agents.ModelSettings(temperature=0, max_tokens=200))
            if not stream:
                return await agents.Runner.run(agent, "Weather in Paris?", max_turns=3), script
            result = agents.Runner.run_streamed(agent, "Weather in Paris?", max_turns=3)
            async for _ in result.stream_events():
                pass
            return result, script

    result, script = asyncio.run(main())
    assert seen == ["Paris"]
    assert result.final_output == ANSWER
    assert [type(i).__name__ for i in result.new_items] == [  # the analysis channel reaches the SDK as reasoning
        "ReasoningItem", "ToolCallItem", "ToolCallOutputItem", "ReasoningItem", "MessageOutputItem"]
    assert len(script.bodies) == 2 and script.bodies[0]["tools"][0]["function"]["name"] == "get_weather"
    srv.wait_idle()


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_responses_and_messages_read_harmony_too(srv, path, monkeypatch):
    """The Responses and Messages routes decode a harmony reply with its special tokens and read it alike: the
    thinking as a reasoning item / thinking block, the call as a function_call / tool_use, no markup."""
    from agentrt.engine.structured import Constraint

    rt, seen = srv.state.runtime, []
    submit = rt.submit

    def forcing(ids, params, **kw):
        seen.append(params.skip_special_tokens)
        params.constraint = Constraint("regex", literal(CALL))
        return submit(ids, params, **kw)

    monkeypatch.setattr(rt, "submit", forcing)
    if path == "/v1/responses":
        body = {"model": "gpt-oss-tiny", "input": ASK[0]["content"], "max_output_tokens": 200, "temperature": 0,
                "tools": [{"type": "function", **WEATHER["function"]}]}
    else:
        body = {"model": "gpt-oss-tiny", "messages": ASK, "max_tokens": 200, "temperature": 0,
                "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]}
    r = httpx.post(srv.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    if path == "/v1/responses":  # a response chain is a program: end it, so its KV is free after the module
        httpx.delete(f"{srv.url}/v1/programs/{r.headers['x-program-id']}", timeout=60)
    assert seen == [False] and not any(m in r.text for m in ("<|", "|>"))
    items = r.json()["output"] if path == "/v1/responses" else r.json()["content"]
    kinds = [i["type"] for i in items]
    if path == "/v1/responses":
        assert kinds == ["reasoning", "function_call"] and json.loads(items[1]["arguments"]) == {"city": "Paris"}
    else:
        assert kinds == ["thinking", "tool_use"] and items[1]["input"] == {"city": "Paris"}
        assert items[0]["thinking"] == THOUGHT and r.json()["stop_reason"] == "tool_use"
