"""Tool calling, structured output and the Responses API through the official `openai` client,
against a live server on the real default model (SmolLM2-135M-Instruct).

A 135M model rarely writes a well-formed call by itself: "required" and a named tool_choice must
still give a call whose arguments validate against the tool's schema (constrained decoding), "auto"
must give either text or a well-formed call, "none" never a call. Streams carry the same calls as
the non-streamed responses (greedy). The tools' parameters are enums and bounded integers, so the
forced calls cannot ramble. Bad input is a 400 naming the field. In-process, `agentrt.chat` with an
`@agentrt.tool` function makes the same greedy call as the same program through `agentrt.connect`.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import anyio
import httpx
import jsonschema
import openai
import pytest

import agentrt
from agentrt._toolcalls import normalize_tools, render_messages
from agentrt.server import ServerConfig
from tests.conftest import assert_all_blocks_free, requires_default_model
from tests.server.live import live_server

pytestmark = [requires_default_model, pytest.mark.slow]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"], "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two small numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                           "b": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a", "b"], "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "languages": {"type": "array", "items": {"enum": ["en", "fr", "es"]}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "languages"], "additionalProperties": False,
}


@pytest.fixture(scope="module")
def srv():
    with live_server(ServerConfig(engine={"num_blocks": 512, "max_num_seqs": 16}, db="none")) as s:
        yield s
        s.wait_idle()
        assert_all_blocks_free(s.state.runtime.engine.core)


@pytest.fixture(scope="module")
def model(srv):
    return srv.state.model_name


def chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def chat(client, model, messages=ASK, **kw):
    return client.chat.completions.create(model=model, messages=messages, **{"max_tokens": 64, "temperature": 0, **kw})


def assert_valid_call(name: str, arguments: str) -> dict:
    assert name in PARAMS, name
    args = json.loads(arguments)
    jsonschema.validate(args, PARAMS[name])
    return args


def streamed_chat(client, model, messages=ASK, **kw):
    """(content, [(id, name, arguments)], finish_reason) accumulated from a streamed chat."""
    content, calls, reason = "", {}, None
    for chunk in chat(client, model, messages, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, ["", "", ""])
                call[0] += d.id or ""
                call[1] += (d.function.name or "") if d.function else ""
                call[2] += (d.function.arguments or "") if d.function else ""
            reason = c.finish_reason or reason
    return content, [tuple(calls[i]) for i in sorted(calls)], reason


# --- chat completions with tools -------------------------------------------------------------
@pytest.mark.parametrize("choice", list(CHOICES))
def test_forced_call_streamed_and_not_then_round_trip(client, model, tok, choice):
    r = chat(client, model, tools=TOOLS, tool_choice=CHOICES[choice])
    (c,) = r.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if choice == "named":
        assert call.function.name == "get_weather"
    args = assert_valid_call(call.function.name, call.function.arguments)

    content, calls, reason = streamed_chat(client, model, tools=TOOLS, tool_choice=CHOICES[choice])
    assert reason == "tool_calls" and content == ""
    ((sid, sname, sargs),) = calls
    assert sid.startswith("call_") and (sname, json.loads(sargs)) == (call.function.name, args)

    result = "18 degrees and sunny" if call.function.name == "get_weather" else "42"
    messages = [*ASK, c.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": result}]
    answer = chat(client, model, messages, tools=TOOLS, tool_choice="auto", max_tokens=24)
    (a,) = answer.choices  # (greedy, this model answers from the result rather than calling again)
    assert a.finish_reason in ("stop", "length") and a.message.content and not a.message.tool_calls
    # the call and its result went back into the prompt, in the Hermes format
    sent = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call.function.model_dump()]},
            {"role": "tool", "content": result}]
    assert answer.usage.prompt_tokens == len(chat_ids(tok, render_messages(sent, normalize_tools(TOOLS))))


# with "auto" the model decides: greedy, it answers the plain question in prose, and after one call
# in the conversation it writes a <tool_call> of its own (both branches are exercised)
EARLIER_CALL = [
    {"role": "user", "content": "What is the weather in Tokyo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]},
    {"role": "user", "content": "What is the weather in Lima?"},
]


@pytest.mark.parametrize("messages", [ASK, EARLIER_CALL], ids=["plain", "after-a-call"])
def test_auto_gives_text_or_a_well_formed_call(client, model, messages):
    r = chat(client, model, messages, tools=TOOLS, tool_choice="auto", max_tokens=40)  # room for a whole call
    (c,) = r.choices
    content, calls, reason = streamed_chat(client, model, messages, tools=TOOLS, tool_choice="auto", max_tokens=40)
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        for call in c.message.tool_calls:
            assert call.id.startswith("call_") and isinstance(json.loads(call.function.arguments), dict)
            assert call.function.name in PARAMS
        assert content == (c.message.content or "")
        assert [(n, json.loads(a)) for _, n, a in calls] == [
            (k.function.name, json.loads(k.function.arguments)) for k in c.message.tool_calls]
    else:
        assert c.finish_reason in ("stop", "length") and c.message.content and "<tool_call>" not in c.message.content
        assert not calls and content == c.message.content
    assert reason == c.finish_reason


def test_none_keeps_the_tools_so_the_answer_reuses_the_calls_prefix(srv, client, model, tok):
    """After a call and its result, an answer asked with tool_choice "none" still has the tools in its
    prompt (as vLLM renders it): its prompt extends the first call's, so the first call's KV is found in
    the prefix cache (without the tools the prompts part at the system message and nothing is reused)."""
    pid = {"X-Program-Id": "tools-none-prefix"}
    ask = [{"role": "user", "content": "Is it raining in Lima this afternoon?"}]  # no other test's prompt
    r = chat(client, model, ask, tools=TOOLS, tool_choice=CHOICES["named"], extra_headers=pid)
    (call,) = r.choices[0].message.tool_calls
    result = "18 degrees and sunny"
    messages = [*ask, r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": result}]
    answer = chat(client, model, messages, tools=TOOLS, tool_choice="none", max_tokens=16, extra_headers=pid)
    assert not answer.choices[0].message.tool_calls and answer.choices[0].message.content
    sent = [*ask, {"role": "assistant", "content": "", "tool_calls": [call.function.model_dump()]},
            {"role": "tool", "content": result}]
    assert answer.usage.prompt_tokens == len(chat_ids(tok, render_messages(sent, normalize_tools(TOOLS))))
    first = r.usage.prompt_tokens  # its question's tokens come after the tools: found only if the prompts agree
    assert answer.usage.prompt_tokens_details.cached_tokens >= (first - 1) // 16 * 16 > 0  # block size 16
    assert httpx.delete(f"{srv.url}/v1/programs/tools-none-prefix").status_code == 200  # its KV pin goes now


def test_none_never_calls(client, model):
    r = chat(client, model, tools=TOOLS, tool_choice="none", max_tokens=16)
    (c,) = r.choices
    assert not c.message.tool_calls and c.finish_reason in ("stop", "length") and c.message.content
    content, calls, reason = streamed_chat(client, model, tools=TOOLS, tool_choice="none", max_tokens=16)
    assert not calls and reason == c.finish_reason and content == c.message.content


# --- output formats ------------------------------------------------------------------------
def test_response_format_json_schema_and_json_object(client, model):
    ask = [{"role": "user", "content": "Describe a French person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = chat(client, model, ask, response_format=fmt, max_tokens=128)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    ask = [{"role": "user", "content": "Return a JSON object with keys city and country for Paris."}]
    r = chat(client, model, ask, response_format={"type": "json_object"}, max_tokens=48)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_completions_guided_json_regex_choice(client, model):
    prompt = "A person described as JSON: "
    r = client.completions.create(model=model, prompt=prompt, max_tokens=128, temperature=0,
                                  extra_body={"guided_json": PERSON})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = client.completions.create(model=model, prompt="The date of the moon landing was ", max_tokens=16,
                                  temperature=0, extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.choices[0].text)
    choices = ["yes", "no", "maybe (later)"]
    r = client.completions.create(model=model, prompt="Is the sky blue? Answer: ", max_tokens=8, n=2,
                                  temperature=1.0, seed=3, extra_body={"guided_choice": choices})
    assert [c.finish_reason for c in r.choices] == ["stop", "stop"]
    assert all(c.text in choices for c in r.choices), [c.text for c in r.choices]


# --- the Responses API ------------------------------------------------------------------------
RESP_TOOL = {"type": "function", "name": "get_weather", "description": WEATHER["function"]["description"],
             "parameters": WEATHER["function"]["parameters"]}
FORCE = {"type": "function", "name": "get_weather"}


def function_calls(resp) -> list:
    return [it for it in resp.output if it.type == "function_call"]


def test_responses_chain_with_tools_is_one_program(client, model, srv, tok):
    # 1. non-streamed, the tool forced
    r1 = client.responses.create(model=model, input="What is the weather in Tokyo?", tools=[RESP_TOOL],
                                 tool_choice=FORCE, max_output_tokens=64, temperature=0)
    assert r1.status == "completed"
    (fc,) = function_calls(r1)
    assert fc.name == "get_weather" and fc.call_id.startswith("call_")
    assert_valid_call(fc.name, fc.arguments)
    pid = r1.model_extra["program_id"]

    # 2. the result back with previous_response_id, streamed through the SDK's helper
    with client.responses.stream(model=model, previous_response_id=r1.id, tools=[RESP_TOOL], tool_choice="none",
                                 input=[{"type": "function_call_output", "call_id": fc.call_id,
                                         "output": "22 degrees and cloudy"}],
                                 max_output_tokens=24, temperature=0) as stream:
        deltas = "".join(ev.delta for ev in stream if ev.type == "response.output_text.delta")
        r2 = stream.get_final_response()
    assert r2.output_text and deltas == r2.output_text and not function_calls(r2)
    assert r2.previous_response_id == r1.id and r2.model_extra["program_id"] == pid
    sent = [{"role": "user", "content": "What is the weather in Tokyo?"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": fc.name, "arguments": fc.arguments}]},
            {"role": "tool", "content": "22 degrees and cloudy"}]
    # the chain is in the prompt, with the tools described ("none" keeps them)
    assert r2.usage.input_tokens == len(chat_ids(tok, render_messages(sent, normalize_tools([RESP_TOOL], "tools"))))
    assert r2.usage.input_tokens_details.cached_tokens >= (r1.usage.input_tokens - 1) // 16 * 16 > 0

    # 3. streamed events, the tool forced again
    events = list(client.responses.create(model=model, previous_response_id=r2.id, input="And in Lima?",
                                          tools=[RESP_TOOL], tool_choice="required", max_output_tokens=64,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for k in ("response.output_item.added", "response.function_call_arguments.delta",
              "response.function_call_arguments.done", "response.output_item.done"):
        assert k in kinds, kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    r3 = events[-1].response
    (fc3,) = function_calls(r3)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert args == fc3.arguments == done.arguments
    assert_valid_call(fc3.name, fc3.arguments)
    assert r3.model_extra["program_id"] == pid

    with httpx.Client(base_url=srv.url) as http:
        prog = http.get(f"/v1/programs/{pid}").json()
    assert prog["calls_done"] == 3


def test_responses_text_format_json_schema(client, model):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(model=model, input="Describe a Spanish person as JSON.", text={"format": fmt},
                                max_output_tokens=128, temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    events = list(client.responses.create(model=model, input="Describe a Spanish person as JSON.",
                                          text={"format": fmt}, max_output_tokens=128, temperature=0, stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == r.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text


# --- bad input ------------------------------------------------------------------------------
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
UNCOMPILABLE = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}


def chat_error(client, model, param, **kw):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, **{"max_tokens": 4, **kw})
    assert e.value.status_code == 400 and e.value.param == param, (e.value.param, e.value.message)
    return e.value


@pytest.mark.parametrize("schema", [BAD_SCHEMA, UNCOMPILABLE], ids=["invalid", "uncompilable"])
def test_bad_response_format_schema(client, model, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    param = "response_format.json_schema.schema" if schema is BAD_SCHEMA else "response_format"
    chat_error(client, model, param, response_format=fmt)


def test_bad_tools_and_tool_messages(client, model):
    bad = {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}
    chat_error(client, model, "tools[0].parameters", tools=[bad])
    unknown = {"type": "function", "function": {"name": "nope"}}
    e = chat_error(client, model, "tool_choice", tools=TOOLS, tool_choice=unknown)
    assert "nope" in e.message
    msgs = [*ASK, {"role": "tool", "content": "18 degrees"}]
    chat_error(client, model, "messages[1].tool_call_id", messages=msgs, tools=TOOLS)


def test_bad_completion_constraints(client, model):
    for extra, param in [({"guided_regex": "(unclosed"}, "guided_regex"),
                         ({"guided_json": BAD_SCHEMA}, "guided_json"),
                         ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="hi", max_tokens=4, extra_body=extra)
        assert e.value.param == param, (extra, e.value.param, e.value.message)


def test_bad_responses_input(client, model):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input="hi", previous_response_id="resp_unknown", max_output_tokens=4)
    assert e.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input=[{"type": "image_generation_call", "id": "x"}], max_output_tokens=4)
    assert e.value.param == "input[0].type"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="hi", tools=[RESP_TOOL],
                                tool_choice={"type": "function", "name": "nope"}, max_output_tokens=4)
    assert e.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="hi", text={"format": {"type": "json_schema", "name": "x",
                                                                          "schema": BAD_SCHEMA}}, max_output_tokens=4)
    assert e.value.param == "text.format.schema"


# --- in-process and through agentrt.connect: the same program ---------------------------------
@agentrt.tool
async def get_weather(city: Literal["Paris", "Tokyo", "Lima"],
                      unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
    """Get the current weather in a city.

    More text that is not part of the description."""
    return f"18 degrees {unit} and sunny in {city}"


@agentrt.program
async def weather_agent(question: str):
    messages = [{"role": "user", "content": question}]
    reply = await agentrt.chat(messages, tools=[get_weather], tool_choice="required", max_tokens=64, temperature=0)
    results = await agentrt.run_tool_calls(reply.tool_calls, [get_weather])
    return reply, results


def test_in_process_and_connect_make_the_same_call(srv):
    spec = agentrt.function_spec(get_weather)["function"]
    assert spec["name"] == "get_weather" and spec["description"] == "Get the current weather in a city."
    assert spec["parameters"]["required"] == ["city"]

    local = agentrt.run(weather_agent, "What is the weather in Lima?", num_blocks=64)

    async def remote():
        async with agentrt.connect(srv.url):
            return await weather_agent("What is the weather in Lima?")

    over_http = anyio.run(remote)
    for reply, results in (local, over_http):
        assert isinstance(reply, agentrt.ChatReply) and reply.finish_reason == "tool_calls"
        (call,) = reply.tool_calls
        assert call.name == "get_weather"
        jsonschema.validate(call.args, spec["parameters"])
        (msg,) = results
        assert msg["role"] == "tool" and msg["tool_call_id"] == call.id
        assert msg["content"] == f"18 degrees {call.args.get('unit', 'celsius')} and sunny in {call.args['city']}"
    assert local[0].tool_calls[0].args == over_http[0].tool_calls[0].args
    assert local[1][0]["content"] == over_http[1][0]["content"]


def test_engine_idle_and_blocks_free_after_all(srv):
    srv.wait_idle()
    core = srv.state.runtime.engine.core
    assert_all_blocks_free(core)
    assert not any(core.num_tracked().values()), core.num_tracked()
