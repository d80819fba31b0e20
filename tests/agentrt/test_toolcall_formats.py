"""The tool-call formats of the models agents run (issue 49): gpt-oss's harmony channels (`openai`),
Qwen3-Coder / Qwen3.5 XML (`qwen3_coder`) and Gemma 3's tool_code text (`gemma3`), each held to 50+
recorded raw outputs (tests/server/data/toolcalls/*.jsonl, written by make_cases.py there from the calls
they stand for): single calls, parallel ones, none, malformed but recoverable, calls inside the reasoning.
For every output the reply of the whole equals the expected calls, content and reasoning, and so does the
stream split at every offset, and character by character; no markup reaches the content or the
reasoning; a reply has calls exactly when the output holds some (the routes' finish_reason "tool_calls")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrt._chat_plan import ChatPlan, Reply, plan_call
from agentrt._reasoning import reasoning_parser
from agentrt._toolparsers import TOOL_CALL_PARSERS, pick_parser, tool_call_parser
from agentrt._xmlcalls import typed

DATA = Path(__file__).parents[1] / "server" / "data" / "toolcalls"
TOOLS = json.loads((DATA / "tools.json").read_text())
FORMATS = {"harmony": "openai", "qwen3_xml": "qwen3_coder", "gemma3": "gemma3"}  # file -> parser name
MARKUP = ("<|channel|>", "<|message|>", "<|call|>", "<|start|>", "<|end|>", "<|return|>", "<|constrain|>",
          "<tool_call>", "</tool_call>", "<function=", "<parameter=", "```tool_code")


def rows(fmt: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{fmt}.jsonl").read_text().splitlines()]


CASES = [pytest.param(fmt, row, id=row["id"]) for fmt in FORMATS for row in rows(fmt)]


def plan_for(fmt: str, row: dict) -> ChatPlan:
    plan = plan_call(TOOLS, "auto").use_template(None, tool_call_parser(FORMATS[fmt]))
    prompt = "<|im_start|>assistant\n<think>\n" if row["thinking"] else "<|im_start|>assistant\n"
    return plan.think(reasoning_parser(row["reasoning_parser"]), prompt)


def streamed(plan: ChatPlan, pieces: list[str]) -> Reply:
    s = plan.streamer()
    shown = [s.feed(p) for p in pieces]
    end = s.finish()
    return Reply("".join(r for r, _ in shown) + end.reasoning, "".join(c for _, c in shown) + end.content,
                 end.tool_calls)


def seen(reply: Reply) -> tuple:
    """What a client sees of a reply: "" and None alike; with calls, the content's surrounding whitespace is
    the streamer's to keep (it shows text before a call as it comes), so it is compared stripped."""
    content = reply.content or None
    if reply.tool_calls and content is not None:
        content = content.strip() or None
    return reply.reasoning or None, content, [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]


def expected(row: dict) -> tuple:
    e = row["expect"]
    calls = [(c["name"], c["arguments"]) for c in e["calls"]]
    content = e["content"].strip() or None if calls and e["content"] is not None else e["content"]
    return e["reasoning"], content, calls


def test_the_recordings_cover_every_kind():
    for fmt in FORMATS:
        got = rows(fmt)
        assert len(got) >= 50, fmt
        assert {r["kind"] for r in got} == {"single", "parallel", "none", "malformed", "reasoning"}, fmt
        assert len({r["text"] for r in got}) == len(got), f"{fmt}: an output recorded twice"
        assert sum(len(r["expect"]["calls"]) > 1 for r in got) >= 10, fmt


@pytest.mark.parametrize("fmt, row", CASES)
def test_a_recorded_output_gives_its_calls_whole_and_streamed_at_every_offset(fmt, row):
    plan, text, want = plan_for(fmt, row), row["text"], expected(row)
    whole = plan.split(text)
    assert seen(whole) == want
    assert bool(whole.tool_calls) == bool(want[2])  # finish_reason "tool_calls" exactly when there are calls
    for k in range(len(text) + 1):
        assert seen(streamed(plan, [text[:k], text[k:]])) == want, f"split at {k}: {text[:k]!r} | {text[k:]!r}"
    assert seen(streamed(plan, list(text))) == want
    for part in (whole.content or "", whole.reasoning or ""):
        leaked = [m for m in MARKUP if m in part and m not in (row["expect"]["content"] or "")]
        assert not leaked, f"markup {leaked} reached the reply: {part!r}"
    assert len({c.id for c in whole.tool_calls}) == len(whole.tool_calls)


def test_each_format_is_picked_from_its_chat_template():
    gpt_oss = (DATA.parent / "templates" / "gpt-oss.jinja").read_text()
    assert pick_parser(gpt_oss).name == "openai"
    qwen3_coder = ("{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>\n<function=example_function_name>\n"
                   "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>")
    assert pick_parser(qwen3_coder).name == "qwen3_coder"
    gemma = "{% if tools %}Write calls in a ```tool_code block: {{ tools | tojson }}{% endif %}"
    assert pick_parser(gemma).name == "gemma3"
    plan = plan_call(TOOLS, "auto").use_template(gpt_oss)
    assert plan.native and plan.harmony is not None and plan.special_tokens


def test_names_as_vllm_spells_them():
    assert TOOL_CALL_PARSERS["qwen3_xml"] is TOOL_CALL_PARSERS["qwen3_coder"]
    assert reasoning_parser("openai_gptoss").channels and not reasoning_parser("qwen3").channels
    # the reasoning parser alone reads the whole output as harmony (vLLM's openai_gptoss), calls included
    plan = plan_call(TOOLS, "auto").think(reasoning_parser("openai_gptoss"), "<|start|>assistant")
    reply = plan.split('<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>Hi')
    assert reply == Reply("hm", "Hi", [])


def test_harmony_without_tools_or_with_tool_choice_none_reads_no_call():
    text = '<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}'
    for plan in (plan_call(None).use_template(None, tool_call_parser("openai")),
                 plan_call(TOOLS, "none").use_template(None, tool_call_parser("openai"))):
        assert plan.split(text) == Reply("x\n{}", None, [])  # the model's act, not an answer


def test_xml_values_are_typed_by_the_schema():
    assert typed(" 7 ", {"type": "integer"}) == 7 and typed("7", {"type": "string"}) == "7"
    assert typed("2.50", {"type": "number"}) == 2.5 and typed("-3", {"type": "number"}) == -3
    assert typed("True", {"type": "boolean"}) is True and typed("maybe", {"type": "boolean"}) == "maybe"
    assert typed('{"a": [1]}', {"type": "object"}) == {"a": [1]} and typed("[1, 'x']", {"type": "array"}) == [1, "x"]
    assert typed("null", {"type": ["integer", "null"]}) is None and typed("5", {"anyOf": [{"type": "integer"}]}) == 5
    assert typed("3", {"enum": [1, 2, 3]}) == 3 and typed("c", {"enum": ["c", "f"]}) == "c"
    assert typed("[1,", {"type": "array"}) == "[1," and typed("x", None) == "x"  # does not read: the text
