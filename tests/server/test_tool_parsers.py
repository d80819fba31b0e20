"""`agentrt serve --tool-call-parser`: a chat template that renders tools gets them, and the conversation's
calls and results, as they are (apply_chat_template(messages, tools=...)), and the calls come back out of
the model's own format, as vLLM serves models trained for tools.

The tiny model (random weights) writes no calls by itself: a regex holds its greedy output to a call in the
parser's format, and every endpoint (chat completions streamed and not, /v1/responses, /v1/messages) must
return exactly those calls. The prompts are compared, id for id, with the template rendered by transformers
on the messages written out by hand."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

import agentrt.server
from agentrt.command import main as cli
from agentrt.engine.structured import Constraint
from agentrt.server import ServerConfig
from tests.agentrt.test_toolparsers import literal
from tests.server.conftest import check_idle
from tests.server.live import live_server, tiny_config
from tests.test_cli import one_line_error
from tests.tool_templates import LLAMA_TEMPLATE, PYTHONIC_TEMPLATE

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "Weather in Paris, and 1 + 2?"}]
LLAMA_CALLS = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "parameters": {"a": 1, "b": 2}}'
PYTHONIC_CALLS = '[get_weather(city="Paris"), add(a=1, b=2)]'
CALLS = [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')]
ANSWER = "It is sunny, and 3."


@pytest.fixture(scope="module")
def srv(tiny_model_path):
    config = tiny_config(tiny_model_path, served_model_name="tiny", chat_template=LLAMA_TEMPLATE,
                         tool_call_parser="llama3_json")
    with live_server(config) as s:
        yield s
        check_idle(s)


@pytest.fixture(scope="module")
def pythonic(tiny_model_path):
    config = tiny_config(tiny_model_path, served_model_name="tiny", chat_template=PYTHONIC_TEMPLATE,
                         tool_call_parser="pythonic")
    with live_server(config) as s, openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0) as c:
        yield c
        check_idle(s)


def chat(client, output: str, messages=ASK, **kw):
    extra = {"structured_outputs": {"regex": literal(output)}, "return_token_ids": True}
    return client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, extra_body=extra,
                                          **{"max_tokens": 96, "temperature": 0, **kw})


def streamed(client, output: str, messages=ASK):
    """(content, [(id, name, arguments)], finish reason) put together from a streamed chat."""
    content, calls, reason = "", {}, None
    for chunk in chat(client, output, messages, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, ["", "", ""])
                call[0] += d.id or ""
                call[1] += d.function.name or ""
                call[2] += d.function.arguments or ""
            reason = c.finish_reason or reason
    return content, [tuple(calls[i]) for i in sorted(calls)], reason


def template_ids(tok, template: str, messages, tools=TOOLS) -> list[int]:
    text = tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                   add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def second_turn(reply, results=("18 degrees", "3")) -> tuple[list, list]:
    """The conversation sent back (the reply as the SDK gives it, tool results by id only) and the messages the
    template must see: the calls' arguments as objects, each result with the name of the function it answers."""
    msg = reply.choices[0].message
    sent = [*ASK, msg.model_dump(exclude_none=True),
            *[{"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(msg.tool_calls, results)]]
    native = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
        for c in msg.tool_calls]},
        *[{"role": "tool", "tool_call_id": c.id, "content": r, "name": c.function.name}
          for c, r in zip(msg.tool_calls, results)]]
    return sent, native


# --- llama3_json --------------------------------------------------------------------------------
def test_llama_json_calls_streamed_and_not(client, tok):
    r = chat(client, LLAMA_CALLS)
    (c,) = r.choices
    assert (c.message.content, c.finish_reason) == (None, "tool_calls")
    assert [(k.type, k.function.name, k.function.arguments) for k in c.message.tool_calls] == \
        [("function", n, a) for n, a in CALLS]
    assert all(k.id.startswith("call_") for k in c.message.tool_calls)
    # the tools went to the template, not into our Hermes text
    assert r.model_extra["prompt_token_ids"] == template_ids(tok, LLAMA_TEMPLATE, ASK)
    prompt = tok.decode(r.model_extra["prompt_token_ids"])
    assert json.dumps(WEATHER) + "\n" + json.dumps(ADD) + "\n<|eot_id|>" in prompt and "<tools>" not in prompt

    content, calls, reason = streamed(client, LLAMA_CALLS)
    assert (content, reason) == ("", "tool_calls")
    assert [(n, a) for _, n, a in calls] == CALLS and all(i.startswith("call_") for i, _, _ in calls)


def test_the_results_go_back_through_the_template(client, tok):
    sent, native = second_turn(chat(client, LLAMA_CALLS))
    r = chat(client, ANSWER, sent)
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason) == \
        (ANSWER, None, "stop")
    assert r.model_extra["prompt_token_ids"] == template_ids(tok, LLAMA_TEMPLATE, native)
    prompt = tok.decode(r.model_extra["prompt_token_ids"])
    assert f"<|start_header_id|>assistant<|end_header_id|>\n\n{LLAMA_CALLS}<|eot_id|>" in prompt
    call_id = native[1]["tool_calls"][0]["id"]
    assert f'{{"output": "18 degrees", "name": "get_weather", "id": "{call_id}"}}<|eot_id|>' in prompt
    assert streamed(client, ANSWER, sent) == (ANSWER, [], "stop")


def test_text_that_is_no_call_is_the_content(client):
    for text in (ANSWER, '{"name": "nope", "parameters": {}}', '{"name": "add", "parameters": {"a": 1}}; {"name": "nope"}'):
        r = chat(client, text)
        assert (r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason) == \
            (text, None, "stop")
        assert streamed(client, text) == (text, [], "stop")


def test_a_forced_call_keeps_its_grammar(client):
    """tool_choice "required" / a named function: the call object by constrained decoding, whatever the parser."""
    pick = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"], "additionalProperties": False}}}
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=[*TOOLS, pick], max_tokens=96, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "pick"}})
    (call,) = r.choices[0].message.tool_calls
    assert (r.choices[0].message.content, r.choices[0].finish_reason, call.function.name) == (None, "tool_calls", "pick")
    assert json.loads(call.function.arguments) in ({"x": "a"}, {"x": "b"})


def test_tokenize_renders_the_tools_as_chat_does(http, tok):
    r = http.post("/tokenize", json={"model": "tiny", "messages": ASK, "tools": TOOLS})
    assert r.status_code == 200 and r.json()["tokens"] == template_ids(tok, LLAMA_TEMPLATE, ASK)


@pytest.fixture
def forced(monkeypatch):
    """Responses and Messages take no regex: Runtime.prepare_chat gives their plan LLAMA_CALLS'."""
    from agentrt._runtime import Runtime

    prepare = Runtime.prepare_chat

    def prepare_chat(rt, messages, **kw):
        return prepare(rt, messages, **{**kw, "output": Constraint("regex", literal(LLAMA_CALLS))})

    monkeypatch.setattr(Runtime, "prepare_chat", prepare_chat)


def test_responses_and_messages_read_the_same_calls(srv, client, forced):
    r = client.responses.create(model="tiny", input=ASK[0]["content"], tools=[
        {"type": "function", **t["function"]} for t in TOOLS], max_output_tokens=96, temperature=0, store=False)
    assert [(o.type, o.name, o.arguments) for o in r.output] == [("function_call", n, a) for n, a in CALLS]
    assert httpx.delete(f"{srv.url}/v1/programs/{r.model_extra['program_id']}").status_code == 200  # its KV pins go
    kw = {"model": "tiny", "max_tokens": 96, "messages": ASK, "extra_body": {"temperature": 0},
          "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                     "input_schema": t["function"]["parameters"]} for t in TOOLS]}
    with anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60) as a:
        m = a.messages.create(**kw)
        with a.messages.stream(**kw) as s:
            final = s.get_final_message()
    expected = [("tool_use", n, json.loads(a)) for n, a in CALLS]
    assert [(b.type, b.name, b.input) for b in m.content] == expected and m.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == expected and final.stop_reason == "tool_use"


# --- pythonic -----------------------------------------------------------------------------------
def test_pythonic_calls_and_their_results(pythonic, tok):
    r = chat(pythonic, PYTHONIC_CALLS)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (None, "tool_calls")
    assert [(k.function.name, k.function.arguments) for k in r.choices[0].message.tool_calls] == CALLS
    assert r.model_extra["prompt_token_ids"] == template_ids(tok, PYTHONIC_TEMPLATE, ASK)
    content, calls, reason = streamed(pythonic, PYTHONIC_CALLS)
    assert (content, [(n, a) for _, n, a in calls], reason) == ("", CALLS, "tool_calls")

    sent, native = second_turn(r)
    again = chat(pythonic, ANSWER, sent)
    assert (again.choices[0].message.content, again.choices[0].message.tool_calls) == (ANSWER, None)
    assert again.model_extra["prompt_token_ids"] == template_ids(tok, PYTHONIC_TEMPLATE, native)
    prompt = tok.decode(again.model_extra["prompt_token_ids"])
    assert f"<|start_header_id|>assistant<|end_header_id|>\n\n{PYTHONIC_CALLS}<|eot_id|>" in prompt
    assert '{"output": "3", "name": "add"}<|eot_id|>' in prompt


# --- the flags ----------------------------------------------------------------------------------
def test_the_flags_reach_the_server_config(monkeypatch):
    got = {}

    def serve(config, *args, **kw):
        got["config"] = config
        return 0

    monkeypatch.setattr(agentrt.server, "serve", serve)
    assert cli(["serve", "m", "--enable-auto-tool-choice", "--tool-call-parser", "mistral"]) == 0
    assert got.pop("config").tool_call_parser == "mistral"
    assert cli(["serve", "m"]) == 0
    assert got.pop("config").tool_call_parser == "auto"


def test_an_unknown_parser_fails_before_the_model_loads(monkeypatch, capsys):
    monkeypatch.setattr(agentrt.server, "create_app", lambda *a, **k: pytest.fail("the app was built"))
    assert cli(["serve", "--tool-call-parser", "qwen9"]) == 2
    one_line_error(capsys, "unknown tool call parser 'qwen9'", "auto", "hermes", "llama3_json", "mistral", "pythonic")
    with pytest.raises(ValueError, match="unknown tool call parser 'x'"):
        ServerConfig(tool_call_parser="x")
