"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) through the official
`anthropic` client, as an Anthropic user or an agent framework's tool loop drives it, against a live
server on the tiny model (random weights, the real tokenizer and chat template) and, in the last
section, on the real default model where sensible text matters.

Every answer is checked against a peer computed apart from the endpoint: the OpenAI chat endpoint
given the equivalent OpenAI messages (the same greedy tokens, prompt, finish and tool calls), the
tokenizer's chat template (prompt token counts), the tool's JSON schema (`jsonschema.validate`) and
the same request streamed or not. Bad requests are Anthropic-shaped errors naming the field.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid

import anthropic
import httpx
import jsonschema
import openai
import pytest

from agentrt.server import ServerConfig
from tests.conftest import assert_all_blocks_free, requires_default_model
from tests.server.conftest import check_idle
from tests.server.live import live_server, tiny_config

BLOCK = 16  # the engine's KV block size: the prefix cache works in whole blocks
ASK = [{"role": "user", "content": "Say something about the sea."}]
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False,
    },
}
ADD = {
    "name": "add",
    "description": "Add two small numbers.",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                       "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False,
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
SYSTEM = (  # about 100 tokens, so a tool loop's prompts span several KV blocks
    "You are the dispatcher of a small weather and arithmetic service. You answer questions from the "
    "operators of a shipping company about the weather in the harbour cities they serve, and you add "
    "small numbers for their cargo manifests. When a question needs fresh data or a sum, call the "
    "matching tool instead of guessing, then answer in one short sentence using the tool's result. "
    "Never invent a city that is not among the tool's choices, never round numbers, and keep every "
    "answer polite, plain and brief."
)
STOP_REASON = {"length": "max_tokens", "stop": "end_turn", "tool_calls": "tool_use"}  # chat's finish -> Anthropic's


# --- fixtures and peers -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(srv):
    with anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oai(srv):
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def chat_ids(tok, messages, **kw) -> list[int]:
    kw = {"add_generation_prompt": True, **kw}
    return tok(tok.apply_chat_template(messages, tokenize=False, **kw), add_special_tokens=False)["input_ids"]


def sdk_kw(**kw) -> dict:
    """Arguments for the SDK's `create` / `stream`: greedy unless told. The SDK (2.x) has no arguments
    for the sampling options, so they go in `extra_body`, as its users send them."""
    extra = {"temperature": 0, **{k: kw.pop(k) for k in ("temperature", "top_p", "top_k") if k in kw}}
    return {**kw, "extra_body": {**extra, **kw.pop("extra_body", {})}}


def create(client, messages=ASK, model="tiny", **kw):
    return client.messages.create(**sdk_kw(model=model, messages=messages, **{"max_tokens": 8, **kw}))


def stream(client, messages=ASK, model="tiny", **kw):
    return client.messages.stream(**sdk_kw(model=model, messages=messages, **{"max_tokens": 8, **kw}))


def block_dict(b) -> dict:
    return b if isinstance(b, dict) else b.model_dump(exclude_none=True)


def openai_messages(messages, system=None) -> list[dict]:
    """The OpenAI chat messages equivalent to an Anthropic conversation: system first, an assistant's
    tool_use blocks as its tool_calls, a user's tool_result blocks as "tool" messages (in block order)."""
    out: list[dict] = []
    if system is not None:
        out.append({"role": "system", "content": system if isinstance(system, str) else
                    [{"type": "text", "text": b["text"]} for b in system]})
    for m in messages:
        if isinstance(m["content"], str):
            out.append({"role": m["role"], "content": m["content"]})
            continue
        texts, calls = [], []
        for b in map(block_dict, m["content"]):
            if b["type"] == "text":
                texts.append(b["text"])
            elif b["type"] == "tool_use":
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b["input"])}})
            elif b["type"] == "tool_result":
                if texts:
                    out.append({"role": "user", "content": "".join(texts)})
                    texts = []
                c = b.get("content", "")
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": c if isinstance(c, str) else "".join(p["text"] for p in c)})
        if m["role"] == "assistant":
            reply = {"role": "assistant", "content": "".join(texts) or None}
            out.append({**reply, "tool_calls": calls} if calls else reply)
        elif texts:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def openai_tool_choice(choice):
    if choice is None:
        return None
    if choice["type"] == "tool":
        return {"type": "function", "function": {"name": choice["name"]}}
    return {"any": "required", "auto": "auto", "none": "none"}[choice["type"]]


def peer(oai, messages=ASK, system=None, tools=None, tool_choice=None, stop_sequences=None, model="tiny", **kw):
    """The same request on the OpenAI chat endpoint."""
    if tools:
        kw["tools"] = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                         "parameters": t["input_schema"]}} for t in tools]
    if tool_choice is not None:
        kw["tool_choice"] = openai_tool_choice(tool_choice)
    if stop_sequences:
        kw["stop"] = stop_sequences
    return oai.chat.completions.create(model=model, messages=openai_messages(messages, system),
                                       **{"max_tokens": 8, "temperature": 0, **kw})


def prompt_tokens(m) -> int:
    """All of a message's prompt tokens: those computed and those served from the prefix cache."""
    return m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def content_of(m) -> list[tuple]:
    """A message's blocks, as the SDK's models of every kind hold them (tool_use ids aside: each call its own)."""
    return [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in m.content]


def texts_of(m) -> str:
    return "".join(b.text for b in m.content if b.type == "text")


def calls_of(m) -> list[tuple[str, dict]]:
    return [(b.name, b.input) for b in m.content if b.type == "tool_use"]


def assert_same_as_peer(m, p) -> None:
    """A Messages reply says what the chat endpoint said for the equivalent request."""
    (c,) = p.choices
    assert texts_of(m) == (c.message.content or "")
    assert calls_of(m) == [(k.function.name, json.loads(k.function.arguments)) for k in c.message.tool_calls or []]
    assert m.stop_reason == STOP_REASON[c.finish_reason], (m.stop_reason, c.finish_reason)
    assert m.usage.output_tokens == p.usage.completion_tokens
    assert prompt_tokens(m) == p.usage.prompt_tokens


def assert_valid_tool_use(block, tools=TOOLS) -> None:
    assert block.type == "tool_use" and block.id.startswith("toolu_") and len(block.id) > len("toolu_")
    assert block.name in [t["name"] for t in tools], block.name
    assert isinstance(block.input, dict)
    jsonschema.validate(block.input, SCHEMAS[block.name])


def raw_events(client, **kw) -> list:
    """The stream's events (pings aside), as `messages.create(stream=True)` yields them."""
    with create(client, stream=True, **kw) as events:
        return [e for e in events if e.type != "ping"]


def assert_event_order(events) -> None:
    """message_start, then per block start / deltas / stop (blocks in index order), message_delta, message_stop."""
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    index = -1
    open_block = False
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert not open_block and e.index == index + 1
            index, open_block = e.index, True
        elif e.type == "content_block_delta":
            assert open_block and e.index == index
        else:
            assert e.type == "content_block_stop" and open_block and e.index == index, e
            open_block = False
    assert not open_block


def error_of(fn, *args, **kw) -> anthropic.APIStatusError:
    with pytest.raises(anthropic.APIStatusError) as e:
        fn(*args, **kw)
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return e.value


# --- a reply ----------------------------------------------------------------------------------
def test_reply_is_an_anthropic_message_saying_what_chat_says(client, oai, tok):
    raw = client.messages.with_raw_response.create(**sdk_kw(model="tiny", messages=ASK, max_tokens=8))
    m = raw.parse()
    assert raw.headers["x-program-id"]
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert [b.type for b in m.content] == ["text"]
    assert m.stop_sequence is None and m.usage.cache_creation_input_tokens == 0
    assert prompt_tokens(m) == len(chat_ids(tok, ASK))
    p = peer(oai)
    assert p.choices[0].finish_reason == "length"  # (random weights: no end of turn within 8 tokens)
    assert_same_as_peer(m, p)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 8
    assert create(client).id != m.id


def test_system_and_text_blocks_render_like_chat(client, oai, tok):
    system = "Be brief. Answer in French."
    as_blocks = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": " Answer in French."}]
    user_blocks = [{"role": "user", "content": [{"type": "text", "text": "Say something "},
                                                {"type": "text", "text": "about the sea."}]}]
    expected = len(chat_ids(tok, [{"role": "system", "content": system}, *ASK]))
    m = create(client, system=system)
    assert prompt_tokens(m) == expected
    assert_same_as_peer(m, peer(oai, system=system))
    for kw in ({"system": as_blocks}, {"system": system, "messages": user_blocks}):
        other = create(client, **kw)
        assert prompt_tokens(other) == expected and content_of(other) == content_of(m)
        assert_same_as_peer(other, peer(oai, **{"messages": ASK, **kw}))


def test_prefilled_assistant_turn_is_continued(client, oai, tok):
    """A last assistant message is a prefill (Anthropic's "putting words in Claude's mouth"): the reply
    goes on from it, and holds only what follows."""
    prefill = [*ASK, {"role": "assistant", "content": "The sea is"}]
    m = create(client, prefill)
    text = tok.apply_chat_template(openai_messages(prefill), tokenize=False, continue_final_message=True)
    assert text.endswith("The sea is")
    assert prompt_tokens(m) == len(tok(text, add_special_tokens=False)["input_ids"])
    p = oai.chat.completions.create(model="tiny", messages=prefill, max_tokens=8, temperature=0,
                                    extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert_same_as_peer(m, p)


def test_sampling_options(client):
    greedy = create(client, max_tokens=12)
    assert content_of(create(client, max_tokens=12, temperature=1.0, top_k=1)) == content_of(greedy)
    m = create(client, max_tokens=4, temperature=0.7, top_p=0.9, top_k=20, metadata={"user_id": "user-1"})
    assert m.usage.output_tokens <= 4 and m.stop_reason in ("end_turn", "max_tokens")


def test_count_tokens_is_the_prompt(client, oai, tok):
    n = client.messages.count_tokens(model="tiny", messages=ASK, system="Be brief.")
    assert n.input_tokens == len(chat_ids(tok, [{"role": "system", "content": "Be brief."}, *ASK]))
    n = client.messages.count_tokens(model="tiny", messages=ASK, tools=TOOLS)
    assert n.input_tokens == peer(oai, tools=TOOLS, max_tokens=1).usage.prompt_tokens > len(chat_ids(tok, ASK))


# --- stop sequences ---------------------------------------------------------------------------
def test_stop_sequence_cuts_the_text_and_is_named(client, oai):
    full = peer(oai, max_tokens=16).choices[0].message.content
    assert len(full) >= 9, full
    needle = next(full[i : i + 3] for i in range(len(full) // 3, len(full) - 3) if full[i : i + 3].strip())
    at = full.index(needle)
    stops = [needle, "\u2603never"]
    m = create(client, max_tokens=16, stop_sequences=stops)
    assert texts_of(m) == full[:at]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", needle)
    assert m.usage.output_tokens == peer(oai, max_tokens=16, stop_sequences=stops).usage.completion_tokens

    with stream(client, max_tokens=16, stop_sequences=stops) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == full[:at] and content_of(final) == content_of(m)
    assert (final.stop_reason, final.stop_sequence, final.usage.output_tokens) == (
        "stop_sequence", needle, m.usage.output_tokens)

    never = create(client, max_tokens=16, stop_sequences=["\u2603never"])
    assert_same_as_peer(never, peer(oai, max_tokens=16))
    assert never.stop_sequence is None and texts_of(never) == full


# --- streaming --------------------------------------------------------------------------------
def test_stream_events_build_the_same_message(client, tok):
    m = create(client, max_tokens=10)
    events = raw_events(client, max_tokens=10)
    assert_event_order(events)
    start = events[0].message
    assert start.id.startswith("msg_") and start.role == "assistant" and start.model == "tiny" and start.content == []
    assert prompt_tokens(start) == len(chat_ids(tok, ASK))
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["text"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert deltas and all(d.type == "text_delta" for d in deltas)
    assert "".join(d.text for d in deltas) == texts_of(m)
    delta = events[-2]
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == (m.stop_reason, None)
    assert delta.usage.output_tokens == m.usage.output_tokens

    with stream(client, max_tokens=10) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == texts_of(m)
    assert (content_of(final), final.stop_reason, final.usage.output_tokens) == (
        content_of(m), m.stop_reason, m.usage.output_tokens)
    assert final.id.startswith("msg_") and final.id != m.id


def test_raw_stream_is_named_sse_events(srv):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 3, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=60) as http, http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-program-id"]
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data] and names[-1] == "message_stop"  # each event's name is its type
    assert not any(line.startswith("data: [DONE]") for line in lines)


def test_closing_a_stream_aborts_the_call(srv, client, oai):
    assert peer(oai, max_tokens=64).choices[0].finish_reason == "length"  # greedy, the reply would go on
    with create(client, stream=True, max_tokens=1500) as events:
        pid = events.response.headers["x-program-id"]
        for e in events:
            if e.type == "content_block_delta":
                break
    srv.wait_idle(timeout_s=15)  # the close reached the engine as an abort
    assert_all_blocks_free(srv.state.runtime.engine.core)
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        prog = http.get(f"/v1/programs/{pid}").json()
    assert prog["num_output_tokens"] < 64, prog


def test_concurrent_calls_match_sequential_ones(srv, client):
    asks = [[{"role": "user", "content": f"Tell me about the number {k}."}] for k in range(4)]
    alone = [create(client, a, max_tokens=6) for a in asks]

    async def together():
        async with anthropic.AsyncAnthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60) as ac:
            return await asyncio.gather(*(ac.messages.create(**sdk_kw(model="tiny", messages=a, max_tokens=6))
                                          for a in asks))

    for one, many in zip(alone, asyncio.run(together())):
        assert (content_of(many), many.stop_reason, many.usage.output_tokens) == (
            content_of(one), one.stop_reason, one.usage.output_tokens)


# --- tools --------------------------------------------------------------------------------------
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = {"any": {"type": "any"}, "tool": {"type": "tool", "name": "get_weather"}}


@pytest.mark.parametrize("choice", list(FORCED))
def test_forced_tool_use_streamed_and_not(client, oai, choice):
    kw = {"messages": WEATHER_ASK, "tools": TOOLS, "tool_choice": FORCED[choice], "max_tokens": 64}
    m = create(client, **kw)
    (block,) = m.content
    assert_valid_tool_use(block)
    if choice == "tool":
        assert block.name == "get_weather"
    assert m.stop_reason == "tool_use" and m.stop_sequence is None
    assert_same_as_peer(m, peer(oai, WEATHER_ASK, **{k: v for k, v in kw.items() if k != "messages"}))

    events = raw_events(client, **kw)
    assert_event_order(events)
    (start,) = [e.content_block for e in events if e.type == "content_block_start"]
    assert start.type == "tool_use" and start.id.startswith("toolu_") and start.name == block.name
    assert start.input == {}  # the input comes as input_json_delta pieces
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert deltas and all(d.type == "input_json_delta" for d in deltas)
    assert json.loads("".join(d.partial_json for d in deltas)) == block.input
    assert (events[-2].delta.stop_reason, events[-2].usage.output_tokens) == ("tool_use", m.usage.output_tokens)

    with stream(client, **kw) as s:
        final = s.get_final_message()
    assert calls_of(final) == calls_of(m) and final.stop_reason == "tool_use"
    assert final.usage.output_tokens == m.usage.output_tokens
    assert all(b.id.startswith("toolu_") for b in final.content)


def test_disable_parallel_tool_use_gives_one_call(client):
    kw = {"messages": WEATHER_ASK, "tools": TOOLS, "max_tokens": 64}
    m = create(client, tool_choice={"type": "any", "disable_parallel_tool_use": True}, **kw)
    (block,) = m.content
    assert_valid_tool_use(block)
    assert calls_of(m) == calls_of(create(client, tool_choice={"type": "any"}, **kw))
    auto = create(client, tool_choice={"type": "auto", "disable_parallel_tool_use": True}, **kw)
    assert len(calls_of(auto)) <= 1


@pytest.mark.parametrize("choice", [None, {"type": "auto"}, {"type": "none"}], ids=["default", "auto", "none"])
def test_unforced_tool_choices_say_what_chat_says(client, oai, choice):
    kw = {"messages": WEATHER_ASK, "tools": TOOLS, "max_tokens": 12}
    if choice is not None:
        kw["tool_choice"] = choice
    m = create(client, **kw)
    assert_same_as_peer(m, peer(oai, **kw))
    if choice == {"type": "none"}:
        assert not calls_of(m) and m.stop_reason != "tool_use"
    with stream(client, **kw) as s:
        final = s.get_final_message()
    assert (texts_of(final), calls_of(final), final.stop_reason) == (texts_of(m), calls_of(m), m.stop_reason)


CONVERSATION = [
    {"role": "user", "content": "What is the weather in Tokyo, and what is 2 plus 3?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me check the weather first."},
        {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Tokyo"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "21 degrees, cloudy"}]},
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_02", "name": "add", "input": {"a": 2, "b": 3}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_02", "content": [{"type": "text", "text": "5"}]},
        {"type": "text", "text": "Now answer both questions."}]},
]


def test_a_conversation_with_tools_is_the_chat_prompt(client, oai):
    system = [{"type": "text", "text": SYSTEM}]
    m = create(client, CONVERSATION, system=system, tools=TOOLS, max_tokens=6)
    p = peer(oai, CONVERSATION, system=system, tools=TOOLS, max_tokens=6)
    assert p.usage.prompt_tokens > 300  # the tools, the calls and the results are all in it
    assert_same_as_peer(m, p)
    counted = client.messages.count_tokens(model="tiny", messages=CONVERSATION, system=system, tools=TOOLS)
    assert counted.input_tokens == p.usage.prompt_tokens
    # a tool_result marked as an error is accepted (how it is worded is the server's choice)
    errored = [*CONVERSATION[:4], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_02", "content": "overflow", "is_error": True}]}]
    assert create(client, errored, tools=TOOLS, max_tokens=2).usage.output_tokens >= 1


def test_tool_loop_of_one_program_reuses_its_prefix(srv, client, oai):
    """An agent framework's loop: a forced tool_use, the assistant message appended as returned, a
    tool_result for its id, the next call. With one X-Program-Id, the second call finds the first
    call's prompt in the prefix cache and reports it as cache_read_input_tokens."""
    pid = f"anthropic-loop-{uuid.uuid4().hex[:8]}"
    headers = {"X-Program-Id": pid, "X-Thread-Id": "main"}
    system = f"[{pid}] {SYSTEM}"  # a prompt no other call has sent: nothing of it is cached at first
    ask = [{"role": "user", "content": "Is it raining in Lima this afternoon?"}]
    http = httpx.Client(base_url=srv.url, timeout=60)
    try:
        raw = client.messages.with_raw_response.create(**sdk_kw(
            model="tiny", system=system, messages=ask, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=64,
            extra_headers=headers))
        r1 = raw.parse()
        assert raw.headers["x-program-id"] == pid and r1.stop_reason == "tool_use"
        (call,) = r1.content
        assert_valid_tool_use(call)
        first = client.messages.count_tokens(model="tiny", system=system, messages=ask, tools=TOOLS).input_tokens
        assert (r1.usage.input_tokens, r1.usage.cache_read_input_tokens or 0) == (first, 0)

        messages = [*ask, {"role": "assistant", "content": r1.content},  # the SDK's blocks, as returned
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": "Light rain, 14 degrees."}]}]
        raw = client.messages.with_raw_response.create(**sdk_kw(
            model="tiny", system=system, messages=messages, tools=TOOLS, max_tokens=8, extra_headers=headers))
        r2 = raw.parse()
        assert raw.headers["x-program-id"] == pid
        assert r2.usage.cache_read_input_tokens >= (first - 1) // BLOCK * BLOCK > 0
        assert_same_as_peer(r2, peer(oai, messages, system=system, tools=TOOLS))

        # the next turn, streamed, its history as plain dicts (model_dump) and a named tool forced
        messages = [*messages, {"role": "assistant", "content": [b.model_dump() for b in r2.content]},
                    {"role": "user", "content": "And what is 40 plus 2?"}]
        kw = {"system": system, "messages": messages, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "add"}}
        with stream(client, max_tokens=64, extra_headers=headers, **kw) as s:
            start = next(e for e in s if e.type == "message_start").message
            r3 = s.get_final_message()
        (add,) = r3.content
        assert_valid_tool_use(add)
        assert add.name == "add"
        counted = client.messages.count_tokens(model="tiny", **kw).input_tokens
        assert prompt_tokens(r3) == prompt_tokens(start) == counted
        prog = http.get(f"/v1/programs/{pid}").json()
        assert (prog["state"], prog["calls_done"], prog["num_threads"]) == ("running", 3, 1)  # all on "main"
        # streamed, the usage splits the prompt the same way: r2's prompt is found in the cache
        reused = (prompt_tokens(r2) - 1) // BLOCK * BLOCK
        assert start.usage.cache_read_input_tokens >= reused, start.usage
        assert r3.usage.cache_read_input_tokens >= reused, r3.usage
    finally:
        assert http.delete(f"/v1/programs/{pid}").status_code == 200  # its KV pins go now
        http.close()


def test_structured_output_format(client, oai):
    """Anthropic's structured outputs (`output_config.format`): the text is JSON valid for the schema, as
    the chat endpoint's json_schema response format gives it."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    m = create(client, max_tokens=16, output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(texts_of(m)), schema)
    assert m.stop_reason == "end_turn"
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    assert_same_as_peer(m, peer(oai, max_tokens=16, response_format=fmt))


# --- errors -------------------------------------------------------------------------------------
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
UNKNOWN_RESULT = [*WEATHER_ASK, {"role": "assistant", "content": [
    {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_unknown", "content": "x"}]}]


@pytest.mark.parametrize("kw,param,named", [
    ({"max_tokens": 0}, "max_tokens", None),
    ({"messages": []}, "messages", None),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE]}]},
     "messages[0].content[1]", "image"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0]", None),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice", "nope"),
    ({"tools": [{"name": "f", "description": "no schema"}]}, "tools[0]", "input_schema"),
    ({"tools": [{"name": "f", "input_schema": BAD_SCHEMA}]}, "tools[0].input_schema", None),
    ({"messages": UNKNOWN_RESULT, "tools": TOOLS}, "messages[2]", "toolu_unknown"),
    ({"temperature": -1}, "temperature", None),
    ({"top_k": 0}, "top_k", None),
    ({"max_tokens": 100_000}, "max_tokens", "100000"),  # over the model's context
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, "messages", None),  # a prompt over it
    ({"tool_choice": {"type": "any"}}, "tool_choice", "any"),  # no tools to choose from
    ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice", None),
    ({"stop_sequences": [""]}, "stop_sequences", None),
    ({"system": [{"type": "image", "source": IMAGE["source"]}]}, "system[0]", "image"),
    ({"messages": [*UNKNOWN_RESULT[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_a", "content": [IMAGE]}]}], "tools": TOOLS},
     "messages[2].content[0].content[0]", "image"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "add", "input": {}}]}],
      "tools": TOOLS}, "messages[0].content[0]", "tool_use"),
], ids=["max_tokens-0", "no-messages", "image-block", "system-role", "unknown-tool-choice", "no-input-schema",
        "bad-input-schema", "unknown-tool-use-id", "temperature", "top_k", "max_tokens-over-context",
        "prompt-over-context", "any-without-tools", "tool-without-name", "empty-stop-sequence", "image-in-system",
        "image-in-tool-result", "tool-use-from-user"])
def test_bad_requests_are_anthropic_400s(client, kw, param, named):
    e = error_of(create, client, **kw)
    assert isinstance(e, anthropic.BadRequestError) and e.status_code == 400
    err = e.body["error"]
    assert err["type"] == "invalid_request_error"
    assert (err.get("param") or "").startswith(param), (kw, err)
    if named:
        assert named in err["message"], err["message"]
    # the same request streamed fails before any event, the same way
    streamed = error_of(create, client, stream=True, **kw)
    assert (streamed.status_code, streamed.body["error"]["type"], streamed.body["error"].get("param")) == (
        400, err["type"], err.get("param"))


def test_missing_max_tokens_is_named(client):
    e = error_of(client.post, "/v1/messages", body={"model": "tiny", "messages": ASK}, cast_to=object)
    assert isinstance(e, anthropic.BadRequestError)
    assert (e.body["error"]["type"], e.body["error"]["param"]) == ("invalid_request_error", "max_tokens")
    assert "max_tokens" in e.body["error"]["message"]


def test_a_model_not_served_is_not_found(client):
    for e in (error_of(create, client, model="nope-model"),
              error_of(client.messages.count_tokens, model="nope-model", messages=ASK)):
        assert isinstance(e, anthropic.NotFoundError) and e.status_code == 404
        assert e.body["error"]["type"] == "not_found_error" and "nope-model" in e.body["error"]["message"]


def test_count_tokens_errors(client):
    e = error_of(client.messages.count_tokens, model="tiny", messages=[])
    assert e.status_code == 400 and e.body["error"]["param"] == "messages"
    e = error_of(client.messages.count_tokens, model="tiny", messages=ASK, tools=[{"name": "f"}])
    assert e.status_code == 400 and e.body["error"]["param"].startswith("tools[0]")


def test_api_keys(tiny_model_path):
    with live_server(tiny_config(tiny_model_path, served_model_name="tiny", api_keys=["k1"])) as s:
        def sdk(**auth):
            return anthropic.Anthropic(base_url=s.url, max_retries=0, timeout=60, **auth)

        with sdk(api_key="k1") as good:  # sent as x-api-key
            assert create(good, max_tokens=1).usage.output_tokens == 1
            assert good.messages.count_tokens(model="tiny", messages=ASK).input_tokens > 0
        with sdk(auth_token="k1") as bearer:  # sent as Authorization: Bearer, as the other endpoints take it
            assert create(bearer, max_tokens=1).usage.output_tokens == 1
        with sdk(api_key="wrong") as bad:
            refused = [error_of(create, bad, max_tokens=1),
                       error_of(bad.messages.count_tokens, model="tiny", messages=ASK)]
        for e in refused:
            assert isinstance(e, anthropic.AuthenticationError) and e.status_code == 401
            assert e.body["error"]["type"] == "authentication_error"
        r = httpx.post(s.url + "/v1/messages", json={"model": "tiny", "messages": ASK, "max_tokens": 1})
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
        check_idle(s)


# --- the real default model: sensible text --------------------------------------------------------
@pytest.fixture(scope="module")
def real():
    """(anthropic client, openai client, model name) on a server of the default model."""
    with live_server(ServerConfig(engine={"num_blocks": 512, "max_num_seqs": 16}, db="none")) as s:
        with (anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=120) as a,
              openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120) as o):
            yield a, o, s.state.model_name
        check_idle(s)


@requires_default_model
@pytest.mark.slow
def test_real_model_ends_its_turn(real):
    client, oai, model = real
    ask = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]
    m = create(client, ask, model, max_tokens=48)
    p = peer(oai, ask, model=model, max_tokens=48)
    assert m.stop_reason == "end_turn" and m.stop_sequence is None and m.model == model
    assert re.search(r"\bParis\b", texts_of(m)), texts_of(m)
    assert_same_as_peer(m, p)
    with stream(client, ask, model, max_tokens=48) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == texts_of(m) and (content_of(final), final.stop_reason) == (content_of(m), "end_turn")


@requires_default_model
@pytest.mark.slow
def test_real_model_answers_from_the_tool_result(real):
    client, oai, model = real
    kw = {"model": model, "system": SYSTEM, "tools": TOOLS}
    r1 = create(client, WEATHER_ASK, tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=64, **kw)
    (call,) = r1.content
    assert_valid_tool_use(call)
    assert call.name == "get_weather" and r1.stop_reason == "tool_use"
    messages = [*WEATHER_ASK, {"role": "assistant", "content": r1.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": "18 degrees and sunny"}]}]
    r2 = create(client, messages, tool_choice={"type": "none"}, max_tokens=32, **kw)
    assert texts_of(r2) and not calls_of(r2) and r2.stop_reason in ("end_turn", "max_tokens")
    assert_same_as_peer(r2, peer(oai, messages, tool_choice={"type": "none"}, max_tokens=32, **kw))
    assert "18 degrees" in texts_of(r2)  # the answer draws on the tool result, which alone says so
