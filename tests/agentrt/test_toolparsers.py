"""Tool-call parsers (vLLM's `--tool-call-parser` names): each format read out of whole outputs and out of
streams split at every position, which must end with the calls and the content of the whole; which parser
`auto` picks from a chat template; and the prompt a template that renders tools gets (tools, calls and
results as they are), beside the unchanged Hermes text for one that does not (SmolLM2's)."""

from __future__ import annotations

import json
import re

import anyio
import pytest

import agentrt
from agentrt._chat_plan import ChatPlan, plan_call
from agentrt._chat_prompt import ChatPrompts, renders_tools
from agentrt._errors import ConfigError
from agentrt._toolcalls import normalize_tools, render_messages
from agentrt._toolparsers import HERMES, PARSER_CHOICES, TOOL_CALL_PARSERS, pick_parser, tool_call_parser
from agentrt.engine.structured import Constraint
from tests.tool_templates import LLAMA_TEMPLATE, PYTHONIC_TEMPLATE, QWEN_TEMPLATE

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
TOOLS = normalize_tools([WEATHER, ADD])
PARIS = ("get_weather", {"city": "Paris"})
ONE_TWO = ("add", {"a": 1, "b": 2})

# (parser, output, content, calls as (name, arguments))
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [PARIS]),
    ("hermes", ('Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
               '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'), "Let me look.",
     [PARIS, ONE_TWO]),  # text before, two calls, arguments as a JSON string
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("hermes", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', ('<tool_call>{"name": "nope", "arguments": {}}'
               "</tool_call>"), []),  # an unknown tool
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3_json", (' \n{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "arguments": '
                    '"{\\"a\\": 1, \\"b\\": 2}"}'), None, [PARIS, ONE_TWO]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [ONE_TWO]),
    ("llama3_json", 'Sure. <|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "Sure.", [ONE_TWO]),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}} That is all.', "That is all.", [ONE_TWO]),
    ("llama3_json", 'I think {"name": "add", "parameters": {"a": 1}}', 'I think {"name": "add", "parameters": {"a": 1}}',
     []),  # JSON after text, without the tag: text
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "x"', ('{"name": "add", "parameters": '
                    '{"a": 1, "b": 2}}; {"name": "x"'), []),  # a broken second call: all of it text
    ("llama3_json", '{"a": 1}', '{"a": 1}', []),
    ("mistral", ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": '
                '{"a": 1, "b": 2}}]'), None, [PARIS, ONE_TWO]),
    ("mistral", 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]', "Checking.",
     [PARIS]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', None,
     [PARIS, ONE_TWO]),  # the newer format, one marker per call
    ("mistral", '[{"name": "add", "arguments": {"a": 1, "b": 2}}]', None, [ONE_TWO]),  # the marker skipped
    ("mistral", "[1] is a citation.", "[1] is a citation.", []),
    ("mistral", "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
    ("pythonic", '[get_weather(city="Paris")]', None, [PARIS]),
    ("pythonic", "\n[get_weather(city='Paris'), add(a=1, b=2)]\n", None, [PARIS, ONE_TWO]),
    ("pythonic", "<|python_start|>[add(a=1, b=2)]<|python_end|>", None, [ONE_TWO]),
    ("pythonic", '[add(a={"x": [1, true, null]}, b=-2)]', None, [("add", {"a": {"x": [1, True, None]}, "b": -2})]),
    ("pythonic", 'Sure: [get_weather(city="Paris")]', 'Sure: [get_weather(city="Paris")]', []),  # only a whole output
    ("pythonic", '[get_weather("Paris")]', '[get_weather("Paris")]', []),  # positional arguments
    ("pythonic", "[nope(a=1)]", "[nope(a=1)]", []),
    ("pythonic", "[add(a=x)]", "[add(a=x)]", []),  # not a literal
    ("pythonic", "[1, 2]", "[1, 2]", []),
    ("pythonic", "Hello!", "Hello!", []),
]


def literal(text: str) -> str:
    """A regex matching exactly `text` (re.escape escapes spaces and newlines, which grammars do not take)."""
    return "".join("\\" + c if c in r".^$*+?{}[]\|()" else c for c in text)


def named(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def stream(parser_name: str, pieces: list[str]) -> tuple[list[str], str, list]:
    """The content a streamer shows for each piece, what `finish` adds, and the calls."""
    s = TOOL_CALL_PARSERS[parser_name].streamer()
    shown = [s.feed(p) for p in pieces]
    rest, calls = s.finish(TOOLS)
    return shown, rest, calls


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_parse(name, text, content, calls):
    got_content, got = TOOL_CALL_PARSERS[name].parse(text, TOOLS)
    assert (got_content, named(got)) == (content, calls)
    assert all(c.id.startswith("call_") for c in got) if name != "mistral" else all(
        re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in got)  # Mistral's templates take 9-character ids back


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_a_stream_split_anywhere_ends_as_the_whole(name, text, content, calls):
    start = TOOL_CALL_PARSERS[name].start(text) if calls else len(text)
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        shown, rest, got = stream(name, pieces)
        assert named(got) == calls
        assert text[:start].startswith("".join(shown))  # nothing of a call shows while it streams
        streamed = "".join(shown) + rest
        assert streamed == text if not calls else (streamed.strip() or None) == content


def test_content_flows_until_a_call_may_start():
    s = HERMES.streamer()
    assert [s.feed(p) for p in ["Sure", ", let me", " check. <tool", "_call>", '{"name": "add"}']] == \
        ["Sure", ", let me", " check. ", "", ""]
    s = TOOL_CALL_PARSERS["llama3_json"].streamer()
    assert [s.feed(p) for p in ["\n", " {", '"name"']] == ["", "", ""]  # an output that starts with "{": held
    s = TOOL_CALL_PARSERS["llama3_json"].streamer()
    assert [s.feed(p) for p in [" ", "The", " {a}", " <|python", "_tag|>{"]] == ["", " The", " {a}", " ", ""]
    s = TOOL_CALL_PARSERS["pythonic"].streamer()
    assert [s.feed(p) for p in ["[", "add(a=1)]"]] == ["", ""] and s.finish(TOOLS)[0] == ""
    s = TOOL_CALL_PARSERS["pythonic"].streamer()
    assert [s.feed(p) for p in ["Hi", " [x]"]] == ["Hi", " [x]"]  # not at the start: plain text, shown at once
    s = TOOL_CALL_PARSERS["mistral"].streamer()
    assert [s.feed(p) for p in ["[", "1] is", " [TOOL", "_CALLS][{"]] == ["", "[1] is", " ", ""]
    s = TOOL_CALL_PARSERS["mistral"].streamer()
    assert [s.feed(p) for p in [" [", "{", '"name"']] == ["", "", ""]  # the bare list, its marker skipped


def test_parsers_by_name():
    assert PARSER_CHOICES == ("auto", "gemma3", "hermes", "llama3_json", "llama4_json", "mistral", "openai",
                              "pythonic", "qwen3_coder", "qwen3_xml")
    assert tool_call_parser("auto") is None and tool_call_parser(None) is None
    assert tool_call_parser("hermes") is HERMES and tool_call_parser("llama4_json").name == "llama3_json"
    with pytest.raises(ConfigError, match=r"unknown tool call parser 'qwen9'; choices: \['auto', 'gemma3', 'hermes'"):
        tool_call_parser("qwen9")
    with pytest.raises(ConfigError, match="unknown tool call parser 'x'"):
        agentrt.Runtime(tool_call_parser="x")


# --- the template -------------------------------------------------------------------------------
MISTRAL_LIKE = "{% for m in messages %}[INST]{{ m.content }}{% endfor %}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}" \
               "[/AVAILABLE_TOOLS]{% endif %}{% for c in calls %}[TOOL_CALLS]{% endfor %}"


@pytest.mark.parametrize("template, native, parser", [
    (LLAMA_TEMPLATE, True, "llama3_json"),
    (QWEN_TEMPLATE, True, "hermes"),
    (PYTHONIC_TEMPLATE, True, "pythonic"),
    (MISTRAL_LIKE, True, "mistral"),
    ("{% if tools %}<|python_tag|>{% endif %}{{ messages }}", True, "llama3_json"),
    ("{% if tools %}Call tools as you like{% endif %}{{ messages }}", True, "hermes"),  # no format named: Hermes
    ("<tool_call> tools {{ messages }}", False, "hermes"),  # the word is text, not the variable
    ("{% for tools in messages %}{{ tools }}{% endfor %}", False, "hermes"),  # a loop variable of that name
    ("{% if %}", False, "hermes"),  # does not compile: rendering it names the problem
    (None, False, "hermes"),
])
def test_auto_picks_the_parser_from_the_template(template, native, parser):
    assert renders_tools(template) is native
    plan = plan_call([WEATHER], "auto").use_template(template)
    assert (plan.native, plan.parser.name) == (native, parser)
    assert plan.use_template(template, TOOL_CALL_PARSERS["mistral"]).parser.name == "mistral"  # a named one wins
    if native:
        assert pick_parser(template).name == parser


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris, and 1 + 2?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    {"role": "tool", "tool_call_id": "call_2", "name": "add", "content": "3"},
]


def prompt(tok, template, messages=CONVERSATION, tools=(WEATHER, ADD)) -> str:
    plan = plan_call(list(tools) or None, "auto").use_template(template)
    return ChatPrompts(tok).prompt(plan.render(messages), chat_template=template, tools=plan.template_tools())[0]


def test_a_llama_template_gets_tools_calls_and_results_natively(tok):
    text = prompt(tok, LLAMA_TEMPLATE)
    specs = [json.dumps(t.spec()) for t in TOOLS]
    assert specs[0] == ('{"type": "function", "function": {"name": "get_weather", "description": "The weather in a '
                        'city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}')
    assert text == (
        "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nGiven the following functions, please "
        "respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\n'
        f"{specs[0]}\n{specs[1]}\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris, and 1 + 2?<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "add", "parameters": {"a": 1, "b": 2}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "18 degrees", "name": "get_weather", "id": "call_1"}'
        "<|eot_id|>"
        '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "3", "name": "add", "id": "call_2"}<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_a_qwen_template_gets_tools_calls_and_results_natively(tok):
    text = prompt(tok, QWEN_TEMPLATE, [{"role": "system", "content": "Be brief."}, *CONVERSATION])
    specs = [json.dumps(t.spec()) for t in TOOLS]
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n<tools>\n" + "\n".join(specs) + "\n</tools>\n\nFor each function "
        "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris, and 1 + 2?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 degrees\n</tool_response>\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_without_tools_a_native_template_gets_none(tok):
    text = prompt(tok, LLAMA_TEMPLATE, CONVERSATION[:1], ())
    assert text == ("<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris, and 1 + 2?<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_the_default_template_keeps_the_hermes_text(tok):
    """SmolLM2's template renders no tools: the prompt is what it was, our tools text in the system message."""
    plan = plan_call([WEATHER, ADD], "auto").use_template(tok.chat_template)
    assert (plan.native, plan.parser, plan.template_tools()) == (False, HERMES, None)
    rendered = plan.render(CONVERSATION)
    assert rendered == render_messages(CONVERSATION, TOOLS)
    text = ChatPrompts(tok).prompt(rendered)[0]
    assert text == tok.apply_chat_template(render_messages(CONVERSATION, TOOLS), tokenize=False, add_generation_prompt=True)
    assert "<tools>\n" + json.dumps(TOOLS[0].spec()["function"]) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 degrees\n</tool_response>" in text


def test_a_forced_call_keeps_its_json_whatever_the_parser():
    for name in TOOL_CALL_PARSERS:
        plan = plan_call([WEATHER], "required").use_template(LLAMA_TEMPLATE, TOOL_CALL_PARSERS[name])
        out = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
        assert (plan.split(out).content, named(plan.split(out).tool_calls)) == (None, [PARIS])
        s = plan.streamer()
        assert [s.feed(out[:5]), s.feed(out[5:])] == [("", ""), ("", "")]
        end = s.finish()
        assert (end.content, named(end.tool_calls)) == ("", [PARIS])


def test_a_plan_reads_calls_with_its_parser():
    plan = plan_call([WEATHER, ADD], "auto").use_template(PYTHONIC_TEMPLATE)
    text = '[get_weather(city="Paris"), add(a=1, b=2)]'
    assert (plan.split(text).content, named(plan.split(text).tool_calls)) == (None, [PARIS, ONE_TWO])
    assert ChatPlan().use_template(PYTHONIC_TEMPLATE).split(text) == (None, text, [])  # tool choice "none"


# --- in-process -----------------------------------------------------------------------------------
def test_runtime_reads_calls_in_the_format_of_each_calls_template(tiny_model_path):
    """`auto` (the default): the parser follows the template a call renders with; a named parser holds."""
    outputs = {QWEN_TEMPLATE: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
               LLAMA_TEMPLATE: '{"name": "get_weather", "parameters": {"city": "Paris"}}',
               PYTHONIC_TEMPLATE: '[get_weather(city="Paris")]'}
    ask = [{"role": "user", "content": "Weather in Paris?"}]

    async def main(parser):
        got = []
        async with agentrt.Runtime(str(tiny_model_path), num_blocks=64, tool_call_parser=parser) as rt:
            for template, out in outputs.items():
                r = await agentrt.chat(ask, tools=[WEATHER], max_tokens=64, temperature=0, chat_template=template,
                                       constraint=Constraint("regex", literal(out)))
                got.append((r.text, named(r.tool_calls), r.finish_reason))
            if not r.tool_calls:
                return got, None
            # the reply goes back in the template's own format
            history = [*ask, r.message(), {"role": "tool", "tool_call_id": r.tool_calls[0].id, "content": "18C"}]
            plan = rt.plan_template(plan_call([WEATHER]), PYTHONIC_TEMPLATE)
            text, _ = rt.chat_prompt(plan.render(history), chat_template=PYTHONIC_TEMPLATE, tools=plan.template_tools())
        return got, text

    got, text = anyio.run(main, "auto")
    assert got == [(None, [PARIS], "tool_calls")] * 3
    assert '[get_weather(city="Paris")]<|eot_id|>' in text and '{"output": "18C", "name": "get_weather"' in text
    got, _ = anyio.run(main, "llama3_json")
    assert got == [(outputs[QWEN_TEMPLATE], [], "stop"), (None, [PARIS], "tool_calls"),
                   (outputs[PYTHONIC_TEMPLATE], [], "stop")]
