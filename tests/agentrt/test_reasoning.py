"""Reasoning outputs (vLLM's `--reasoning-parser`): the think-tag parser on whole outputs and on streams
split at every position, under both template styles (the prompt opens the think block, or the model
does), a prompt that closes it (`enable_thinking=False`), outputs cut short, without tags, and with a
tool call after the thinking; then `agentrt.Runtime(reasoning_parser=...)` on the tiny model, its
output forced into shape by a regex."""

from __future__ import annotations

import json
import re

import anyio
import pytest

import agentrt
from agentrt._chat_plan import ChatPlan, Reply, plan_call
from agentrt._reasoning import REASONING_PARSERS, ThinkTagParser, reasoning_parser
from agentrt.engine.structured import Constraint

QWEN3 = reasoning_parser("qwen3")

# prompts as the templates end them
MODEL_OPENS = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # Qwen3: the model writes <think>
PROMPT_OPENS = "<｜User｜>hi<｜Assistant｜><think>\n"  # DeepSeek-R1, Qwen3.5: the template opens the block
PROMPT_CLOSES = MODEL_OPENS + "<think>\n\n</think>\n\n"  # Qwen3 with enable_thinking=False

# (output, the prompt opened a block, reasoning, content)
CASES = [
    ("<think>\nI should greet.\n</think>\n\nHello there!", False, "\nI should greet.\n", "Hello there!"),
    ("I should greet.\n</think>\n\nHello!", True, "I should greet.\n", "Hello!"),
    ("<think>twice</think>answer", True, "twice", "answer"),  # a model that opens an already open block
    (" \n<think>a</think> \n b", False, "a", "b"),
    ("Hello!", False, None, "Hello!"),  # enable_thinking=False: all content
    ("Hello <b>world</b>", False, None, "Hello <b>world</b>"),  # no think tags at all
    ("<thinking>no</thinking>", False, None, "<thinking>no</thinking>"),  # starts like the tag, is not it
    ("Hi <think>x</think>", False, None, "Hi <think>x</think>"),  # a block not at the start is text
    ("<think>\nstill thinking", False, "\nstill thinking", None),  # cut short inside the block
    ("still thinking</thi", True, "still thinking</thi", None),  # cut short inside the end tag
    ("<thi", False, None, "<thi"),  # cut short inside what might have been the start tag
    ("<think></think>Answer", False, None, "Answer"),  # an empty block
    ("<think>only</think>\n\n", False, "only", None),  # thought, then no answer
    ("a < b </think>c", True, "a < b ", "c"),  # a "<" that starts no tag
    ("", True, None, None),
    ("", False, None, ""),
]


def stream(parser: ThinkTagParser, pieces: list[str], thinking: bool) -> tuple[list[str], list[str]]:
    """Every (reasoning, content) piece a streamer shows for these pieces, its final flush included."""
    s = parser.streamer(thinking)
    shown = [s.feed(p) for p in pieces] + [s.finish()]
    return [r for r, _ in shown], [c for _, c in shown]


@pytest.mark.parametrize("text, thinking, reasoning, content", CASES)
def test_split(text, thinking, reasoning, content):
    assert QWEN3.split(text, thinking) == (reasoning, content)


@pytest.mark.parametrize("text, thinking, reasoning, content", CASES)
def test_a_stream_split_anywhere_gives_the_same_split(text, thinking, reasoning, content):
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts += [[text[:i], text[i:j], text[j:]] for i in range(len(text) + 1) for j in range(i, len(text) + 1)]
    for pieces in [*cuts, list(text)]:
        rs, cs = stream(QWEN3, pieces, thinking)
        assert "".join(rs) == (reasoning or ""), pieces
        assert "".join(cs) == (content or ""), pieces


def test_a_stream_never_shows_part_of_a_tag():
    text = "<think>\nplan it\n</think>\n\nthe answer"
    for pieces in ([text[:i], text[i:]] for i in range(len(text) + 1)):
        rs, cs = stream(QWEN3, pieces, False)
        for piece in rs + cs:
            assert "<" not in piece and ">" not in piece, (pieces, piece)
        assert (rs[-1], cs[-1]) == ("", "")  # nothing held back at the end: every tag completed
    rs, cs = stream(QWEN3, list(text), False)
    assert [r for r in rs if r] == list("\nplan it\n") and [c for c in cs if c] == list("the answer")


def test_reasoning_shows_before_the_answer_is_known():
    s = QWEN3.streamer(thinking=True)
    assert s.feed("Let me") == ("Let me", "")
    assert s.feed(" see</") == (" see", "")  # "</" may start the end tag: held
    assert s.feed("think>") == ("", "")
    assert s.feed("\n\n") == ("", "")  # the whitespace before the answer is dropped
    assert s.feed(" Yes.") == ("", "Yes.")
    assert s.feed(" </think> still") == ("", " </think> still")  # after the block, tags are text
    assert s.finish() == ("", "")


@pytest.mark.parametrize("prompt, thinking", [
    (MODEL_OPENS, False),
    (PROMPT_OPENS, True),
    (PROMPT_CLOSES, False),
    (PROMPT_OPENS + "I began</think>", False),  # a prefill (continue_final_message) that closed it
    (PROMPT_OPENS + "I began", True),  # a prefill still inside the block
    ("<think>a</think>b<|im_end|>\n" + MODEL_OPENS, False),  # earlier turns' blocks are closed
    ("<think>a</think>b<|im_end|>\n" + PROMPT_OPENS, True),
    ("", False),
])
def test_the_prompt_says_whether_the_output_starts_in_reasoning(prompt, thinking):
    assert QWEN3.prompt_thinking(prompt) is thinking


def test_parsers_by_name():
    assert set(REASONING_PARSERS) >= {"deepseek_r1", "qwen3"}
    assert reasoning_parser("deepseek_r1").split("x</think>y", True) == ("x", "y")
    assert reasoning_parser(None) is None
    custom = ThinkTagParser("seed", "<seed:think>", "</seed:think>")
    assert reasoning_parser(custom) is custom
    assert custom.split("<seed:think>a</seed:think>b", False) == ("a", "b")
    with pytest.raises(agentrt.ConfigError) as e:
        reasoning_parser("qwen9")
    assert "'qwen9'" in str(e.value) and "deepseek_r1" in str(e.value) and "qwen3" in str(e.value)
    assert isinstance(e.value, ValueError)
    with pytest.raises(agentrt.ConfigError, match="unknown reasoning parser"):
        agentrt.Runtime(reasoning_parser="nope")


# --- with tool calls: calls come from the content only ------------------------------------------
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                             "parameters": CITY}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def streamed(plan: ChatPlan, pieces: list[str]) -> Reply:
    s = plan.streamer()
    shown = [s.feed(p) for p in pieces]
    end = s.finish()
    return Reply("".join(r for r, _ in shown) + end.reasoning, "".join(c for _, c in shown) + end.content,
                 end.tool_calls)


def test_a_tool_call_after_thinking():
    plan = plan_call(WEATHER, "auto").think(QWEN3, MODEL_OPENS)
    text = f"<think>\nI need the weather.\n</think>\n\n{CALL}"
    reasoning, content, calls = plan.split(text)
    assert (reasoning, content) == ("\nI need the weather.\n", None)
    assert [(c.name, c.args) for c in calls] == [("get_weather", {"city": "Paris"})]
    for i in range(len(text) + 1):
        r, c, calls = streamed(plan, [text[:i], text[i:]])
        assert (r, c) == ("\nI need the weather.\n", "")
        assert [(k.name, k.args) for k in calls] == [("get_weather", {"city": "Paris"})]


def test_a_tool_call_in_the_thinking_is_no_call():
    plan = plan_call(WEATHER, "auto").think(QWEN3, PROMPT_OPENS)
    text = f"maybe {CALL}? no.</think>It is sunny."
    assert plan.split(text) == (f"maybe {CALL}? no.", "It is sunny.", [])
    for i in range(len(text) + 1):
        assert streamed(plan, [text[:i], text[i:]]) == (f"maybe {CALL}? no.", "It is sunny.", [])


def test_text_that_looks_like_a_call_after_thinking_is_content():
    plan = plan_call(WEATHER, "auto").think(QWEN3, MODEL_OPENS)
    text = "<think>hm</think>See <tool_call>not json</tool_call>"
    assert plan.split(text) == ("hm", "See <tool_call>not json</tool_call>", [])
    assert streamed(plan, list(text)) == ("hm", "See <tool_call>not json</tool_call>", [])


def test_a_forced_call_is_not_parsed_for_reasoning():
    plan = plan_call(WEATHER, "required").think(QWEN3, PROMPT_OPENS)  # its grammar makes it a call from token 1
    assert plan.reasoning is None
    reasoning, content, calls = plan.split(json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}}))
    assert (reasoning, content, [(c.name, c.args) for c in calls]) == (None, None, [("get_weather", {"city": "Oslo"})])


def test_a_json_output_is_not_parsed_for_reasoning():
    """Its grammar holds it to JSON from the first token, even after a prompt that opened a think block."""
    for fmt in (Constraint.json_schema({"type": "object"}), Constraint("json_object")):
        plan = plan_call(output=fmt).think(QWEN3, PROMPT_OPENS)
        assert plan.reasoning is None and plan.split('{"a": 1}') == (None, '{"a": 1}', [])
    plan = plan_call(output=Constraint("regex", "[a-z]+</think>[a-z]+")).think(QWEN3, PROMPT_OPENS)
    assert plan.split("abc</think>de") == ("abc", "de", [])


def test_without_a_parser_the_output_is_untouched():
    text = "<think>x</think>y"
    for plan in (ChatPlan(), plan_call(WEATHER, "none"), ChatPlan().think(None, PROMPT_OPENS)):
        assert plan.split(text) == (None, text, [])
        assert streamed(plan, list(text)) == ("", text, [])


# --- in-process -----------------------------------------------------------------------------------
SHAPE = r"<think>([a-z ]{1,20})</think>\n\n([a-z][a-z ]{0,15})"  # an output the tiny model is held to
MESSAGES = [{"role": "user", "content": "Think, then say something."}]


def test_runtime_with_a_reasoning_parser(tiny_model_path):
    """The tiny model never thinks by itself: a regex holds its output to a think block and an answer."""
    constraint = Constraint("regex", SHAPE.replace("(", "").replace(")", ""))
    kw = {"max_tokens": 64, "temperature": 0, "constraint": constraint}

    async def main():
        async with agentrt.Runtime(str(tiny_model_path), num_blocks=64, reasoning_parser="qwen3") as rt:
            r = await agentrt.chat(MESSAGES, full=True, **kw)
            text = await agentrt.chat(MESSAGES, **kw)
            chunks = [c async for c in agentrt.chat_stream(MESSAGES, full=True, **kw)]
            pieces = [p async for p in agentrt.chat_stream(MESSAGES, **kw)]
            return r, text, chunks, pieces, rt.tokenizer.decode(r.choices[0].token_ids, skip_special_tokens=True)

    r, text, chunks, pieces, raw = anyio.run(main)
    thought, answer = re.fullmatch(SHAPE, raw).groups()
    assert (r.reasoning, r.text, r.content, r.finish_reason) == (thought, answer, answer, "stop")
    assert r.message() == {"role": "assistant", "content": answer}  # the thinking stays out of the history
    assert text == answer
    assert "".join(c.reasoning for c in chunks) == thought and "".join(c.text for c in chunks) == answer
    assert chunks[-1].finish_reason == "stop"
    assert "".join(pieces) == answer  # plain pieces: the answer's only
