"""A tool loop written the obvious way, in-process and through `agentrt.connect`: the reply's `tool_calls` go
back into the conversation as they come (ToolCall objects), or the reply itself, or OpenAI's dicts, the tools'
results after them, and the next chat reads the same prompt every way. Bad messages are an InvalidCallError
naming the field and the value, the same on both sides.

The tiny model writes the call under tool_choice="required" (constrained decoding, an enum argument)."""

from __future__ import annotations

import re
from typing import Literal

import anyio
import pytest

import agentrt

STYLES = ("objects", "reply", "choice", "openai_dicts", "flat_dicts")


@agentrt.tool
async def lookup(key: Literal["k", "j"]) -> str:
    """Look a key up."""
    return f"value of {key}"


def assistant_turn(style: str, r: agentrt.Result) -> object:
    calls = r.choices[0].tool_calls
    if style == "objects":  # the README's loop: the calls appended as they come
        return {"role": "assistant", "content": r.choices[0].text, "tool_calls": calls}
    if style == "reply":
        return r
    if style == "choice":
        return r.choices[0]
    if style == "openai_dicts":
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
    return {"role": "assistant", "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.args} for c in calls]}


@agentrt.program
async def tool_loop() -> dict:
    """One call, its tool run, the conversation continued in each style: {style: (prompt tokens, text, streamed)}."""
    messages = [{"role": "user", "content": "look up k"}]
    r = await agentrt.chat(messages, tools=[lookup], tool_choice="required", max_tokens=64, temperature=0)
    calls = r.choices[0].tool_calls
    assert r.finish_reason == "tool_calls" and calls and all(isinstance(c, agentrt.ToolCall) for c in calls)
    results = await agentrt.run_tool_calls(calls, [lookup])
    assert [m["tool_call_id"] for m in results] == [c.id for c in calls]
    assert results[0]["content"] == f"value of {calls[0].args['key']}"
    assert await agentrt.run_tool_calls([c.to_dict() for c in calls], [lookup]) == results  # as dicts too
    out = {}
    for style in STYLES:
        history = [*messages, assistant_turn(style, r), *results]
        again = await agentrt.chat(history, max_tokens=4, temperature=0, full=True)
        streamed = "".join([t async for t in agentrt.chat_stream(history, max_tokens=4, temperature=0)])
        out[style] = (again.usage.prompt_tokens, again.text, streamed)
    without = await agentrt.chat(messages, max_tokens=4, temperature=0, full=True)
    return {"styles": out, "plain_prompt_tokens": without.usage.prompt_tokens, "calls": [c.to_dict() for c in calls]}


def test_a_tool_loop_runs_in_process_and_through_connect(srv, tiny_model_path):
    async def in_process():
        async with agentrt.Runtime(str(tiny_model_path), num_blocks=64):
            return await tool_loop()

    async def remote():
        async with agentrt.connect(srv.url):
            return await tool_loop()

    local, over_http = anyio.run(in_process), anyio.run(remote)
    for got in (local, over_http):
        (first, *rest) = got["styles"].values()
        assert all(r == first for r in rest), got["styles"]  # every style reads the same prompt
        assert first[1] == first[2]  # greedy: the plain and the streamed reply agree
        assert first[0] > got["plain_prompt_tokens"] + 10  # the call and its result are in the prompt
    assert [c["function"] for c in local["calls"]] == [c["function"] for c in over_http["calls"]]
    assert [v for v in local["styles"].values()] == [v for v in over_http["styles"].values()]


def bad_histories(r: agentrt.Result) -> list[tuple[list, str, str]]:
    """(messages, the param the error names, a piece of the message showing the bad value)."""
    ask = {"role": "user", "content": "look up k"}
    call = r.choices[0].tool_calls[0]
    ok_call = {"role": "assistant", "content": None, "tool_calls": [call]}
    answer = {"role": "tool", "tool_call_id": call.id, "content": "v"}
    return [
        ([ask, {"role": "assistant", "content": None, "tool_calls": [42]}], "messages[1].tool_calls[0]", "got 42"),
        ([ask, {"role": "assistant", "content": None, "tool_calls": call}], "messages[1].tool_calls", "ToolCall"),
        ([ask, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "lookup"}}]}],
         "messages[1].tool_calls[0].id", "got None"),
        ([ask, {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": 7}}]}],
         "messages[1].tool_calls[0].function.name", "got 7"),
        ([ask, ok_call, {"role": "tool", "content": "v"}], "messages[2].tool_call_id", "tool_call_id"),
        ([ask, {"role": "assistant", "content": r}], "messages[1].content", "Result"),
        ([ask, r.choices[0].message, answer], "messages[1]", "reply.message()"),
        ([ask, 5], "messages[1]", "got 5"),
        ([{"role": "robot", "content": "x"}], "messages[0].role", "'robot'"),
        ([{"role": "user", "content": 5}], "messages[0].content", "got 5"),
        ([{"role": "user"}], "messages[0].content", "'content'"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         "messages[0].content[0]", "image_url"),
        ("look up k", "messages", "'look up k'"),
    ]


@agentrt.program
async def bad_loop() -> list[tuple[str, str | None, str]]:
    r = await agentrt.chat([{"role": "user", "content": "look up k"}], tools=[lookup], tool_choice="required",
                           max_tokens=64, temperature=0)
    out = []
    for messages, param, shows in bad_histories(r):
        with pytest.raises(agentrt.InvalidCallError) as err:
            await agentrt.chat(messages, max_tokens=2)
        assert shows in str(err.value), (param, str(err.value))
        assert err.value.program_id == agentrt.current_program_id()
        out.append((type(err.value).__name__, err.value.param, str(err.value)))
        assert err.value.param == param, str(err.value)
    with pytest.raises(agentrt.InvalidCallError, match=r"calls\[0\].*got 'x'"):
        await agentrt.run_tool_calls(["x"], [lookup])
    return out


def test_bad_messages_are_the_same_error_on_both_sides(srv, tiny_model_path):
    async def in_process():
        async with agentrt.Runtime(str(tiny_model_path), num_blocks=64):
            return await bad_loop()

    async def remote():
        async with agentrt.connect(srv.url):
            return await bad_loop()

    def same(errors):  # the call ids differ, and the program ids
        return [(kind, param, re.sub(r"call_\w+", "call_", text.split(" (program=")[0]))
                for kind, param, text in errors]

    local, over_http = anyio.run(in_process), anyio.run(remote)
    assert same(local) == same(over_http)
