"""Tool-call parsers, as vLLM's `--tool-call-parser` names them: the calls a model writes in the format it
was trained on, read out of its text.

    hermes        <tool_call>{"name": "f", "arguments": {...}}</tool_call>, any number, text around them
                  (Qwen2.5, Qwen3, Hermes; and our own prompt for templates that know no tools)
    llama3_json   {"name": "f", "parameters": {...}}; {"name": "g", ...}   (Llama 3.1 / 3.2 / 4 JSON), at the
                  start of the output or after <|python_tag|>
    mistral       [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]   or [TOOL_CALLS]f[ARGS]{...}
    pythonic      [f(city="Paris"), g(x=1)]   (Llama 3.2 / 4 pythonic), the whole output
    gemma3        ```tool_code\nf(city="Paris")\n```   anywhere, or [f(city="Paris")] first (Gemma 3; our name)
    qwen3_coder   <tool_call><function=f><parameter=city>Paris</parameter></function></tool_call>
    (qwen3_xml)   (Qwen3-Coder, Qwen3.5; agentrt._xmlcalls), inside the thinking too
    openai        gpt-oss's harmony channels: <|channel|>commentary to=functions.f <|constrain|>json
                  <|message|>{...}<|call|>, the analysis channel as reasoning (agentrt._harmony)

A call starts at one of the parser's `markers`, anywhere in the output, or at one of its `openers` when
the output begins with it (after whitespace). `parse` splits a finished output into content and calls;
what does not parse as calls of the given tools stays content, unchanged. `streamer` shows content as
it comes and holds back from where a call may be starting, so that a streamed output ends with the calls
`parse` finds. Special tokens (`[TOOL_CALLS]`, `<|python_tag|>`) leave the text when the output skips them
(the default): the bare JSON they introduce, at the output's start, is then read the same.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
from typing import Any, ClassVar

from agentrt._callparse import DECODER, ToolParser, skip_ws
from agentrt._errors import ConfigError
from agentrt._harmony import HARMONY
from agentrt._toolcalls import FunctionTool, ToolCall, call_from
from agentrt._xmlcalls import QWEN3_XML


class HermesParser(ToolParser):
    """`<tool_call>{json}</tool_call>` blocks (the last may lack its end tag, cut short); each block on its
    own: one that does not parse, or names an unknown tool, stays in the content."""

    name = "hermes"
    markers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def extract(self, text: str, tools: list[FunctionTool]) -> tuple[str, list[ToolCall]]:
        names = {t.name for t in tools}
        calls: list[ToolCall] = []
        kept: list[str] = []
        pos = 0
        for m in self._BLOCK.finditer(text):
            try:
                call = call_from(json.loads(m.group(1).strip()), names, self.new_id)
            except ValueError:
                call = None
            if call is None:
                continue
            kept.append(text[pos:m.start()])
            calls.append(call)
            pos = m.end()
        kept.append(text[pos:])
        return "".join(kept), calls


class Llama3JsonParser(ToolParser):
    """JSON objects `{"name", "parameters" (or "arguments")}` separated by `;`, at the start of the output
    or after `<|python_tag|>`; text after them is content. All of them must be calls of known tools."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    openers = ("{",)

    def read(self, text: str, pos: int, names: set[str]) -> tuple[list[ToolCall], int] | None:
        pos = skip_ws(text, pos)
        if text.startswith(self.markers[0], pos):
            pos += len(self.markers[0])
        calls: list[ToolCall] = []
        while True:
            try:
                obj, end = DECODER.raw_decode(text, skip_ws(text, pos))
            except ValueError:
                return None
            call = call_from(obj, names, self.new_id)
            if call is None:
                return None
            calls.append(call)
            pos = end
            after = skip_ws(text, pos)
            if not text.startswith(";", after) or not text.startswith("{", skip_ws(text, after + 1)):
                return calls, pos
            pos = after + 1


class MistralParser(ToolParser):
    """`[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}` objects (or one object), or the newer
    `[TOOL_CALLS]name[ARGS]{...}`, repeated per call; content may come before the first. Call ids are
    nine letters and digits, as Mistral's templates require of the ids they are given back."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    openers = ("[{",)  # the list itself, when the marker was skipped as a special token
    _NAMED = re.compile(r"\s*([A-Za-z0-9_\-]{1,64})\[ARGS\]")

    def new_id(self) -> str:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def read(self, text: str, pos: int, names: set[str]) -> tuple[list[ToolCall], int] | None:
        calls: list[ToolCall] = []
        while True:
            at = skip_ws(text, pos)
            marked = text.startswith(self.markers[0], at)
            if marked:
                at += len(self.markers[0])
            elif calls:
                return calls, pos
            named = self._NAMED.match(text, at)
            try:
                if named:
                    args, end = DECODER.raw_decode(text, skip_ws(text, named.end()))
                    objs: Any = [{"name": named.group(1), "arguments": args}]
                else:
                    objs, end = DECODER.raw_decode(text, skip_ws(text, at))
            except ValueError:
                return None
            objs = objs if isinstance(objs, list) else [objs]
            found = [call_from(o, names, self.new_id) for o in objs]
            if not found or None in found:
                return None
            calls += found  # type: ignore[arg-type]
            pos = end
            if not marked:  # the bare list: one
                return calls, pos


class PythonicParser(ToolParser):
    """A Python list of calls with keyword arguments of literal values, `[f(a=1, b="x"), g()]`, as the
    whole output (Llama 4 wraps it in `<|python_start|>`/`<|python_end|>`); `true`/`false`/`null` read as
    JSON's. Anything else is content, as in vLLM's parser."""

    name = "pythonic"
    openers = ("[", "<|python_start|>")
    _NAMES: ClassVar[dict[str, Any]] = {"true": True, "false": False, "null": None}

    def read(self, text: str, pos: int, names: set[str]) -> tuple[list[ToolCall], int] | None:
        body = text[pos:].strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List):
                return None
            calls = [self._call(node, names) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return None
        return (calls, len(text)) if calls and None not in calls else None  # type: ignore[return-value]

    def _call(self, node: ast.expr, names: set[str]) -> ToolCall | None:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
            return None
        if node.func.id not in names or any(k.arg is None for k in node.keywords):
            return None
        args = {k.arg: self._value(k.value) for k in node.keywords}
        return ToolCall(self.new_id(), node.func.id, json.dumps(args))

    def _value(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Name) and node.id in self._NAMES:
            return self._NAMES[node.id]
        if isinstance(node, ast.List):
            return [self._value(v) for v in node.elts]
        if isinstance(node, ast.Dict):
            return {ast.literal_eval(k) if k is not None else None: self._value(v)
                    for k, v in zip(node.keys, node.values, strict=True)}
        return ast.literal_eval(node)


class GemmaParser(PythonicParser):
    """Gemma 3's function-call text, as Google's tool-use prompts for it ask: Python calls in a fenced
    block, ```` ```tool_code\nget_weather(city="Paris")\n``` ```` (one call a line, a list of calls, or
    `print(f(...))`; a `default_api.` prefix is dropped), anywhere in the output, or a pythonic list
    `[f(a=1), g(b=2)]` (any fence around it) at the output's start; text before and after is content. A
    block cut short (no closing fence) reads to the end. Anything that is not calls of known tools with
    keyword arguments of literal values stays content."""

    name = "gemma3"
    markers = ("```tool_code",)
    openers = ("[", "```")
    calls_in_reasoning = True  # a ```tool_code block inside the thinking is a call too
    _FENCE = re.compile(r"```[A-Za-z_]*[ \t]*")

    def read(self, text: str, pos: int, names: set[str]) -> tuple[list[ToolCall], int] | None:
        pos = skip_ws(text, pos)
        fence = self._FENCE.match(text, pos)
        calls: list[ToolCall] = []
        while fence:  # one fenced block, and any ```tool_code blocks right after it
            close = text.find("```", fence.end())
            end = len(text) if close < 0 else close + 3
            found = self._calls(text[fence.end(): close if close >= 0 else len(text)], names)
            if not found:
                break
            calls, pos = calls + found, end
            after = skip_ws(text, pos)
            fence = self._FENCE.match(text, after) if text.startswith(self.markers[0], after) else None
        if calls:
            return calls, pos
        if text.startswith("```", pos):
            return None
        for close in (i for i, ch in enumerate(text) if ch == "]" and i > pos):  # the shortest list that parses
            calls = self._calls(text[pos: close + 1], names)
            if calls:
                return calls, close + 1
        return None

    def _calls(self, body: str, names: set[str]) -> list[ToolCall] | None:
        try:
            tree = ast.parse(body.strip(), mode="exec")
            nodes: list[ast.expr] = []
            for stmt in tree.body:
                if not isinstance(stmt, ast.Expr):
                    return None
                nodes += stmt.value.elts if isinstance(stmt.value, ast.List) else [stmt.value]
            calls = [self._call(self._unwrapped(n), names) for n in nodes]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return None
        return calls if calls and None not in calls else None  # type: ignore[return-value]

    @staticmethod
    def _unwrapped(node: ast.expr) -> ast.expr:
        """`print(f(...))` as `f(...)`, `default_api.f(...)` as `f(...)`."""
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
                and len(node.args) == 1 and not node.keywords):
            node = node.args[0]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
            node = ast.Call(ast.Name(node.func.attr, ast.Load()), node.args, node.keywords)
        return node


HERMES = HermesParser()
TOOL_CALL_PARSERS: dict[str, ToolParser] = {  # vLLM's --tool-call-parser names
    "hermes": HERMES,
    "llama3_json": Llama3JsonParser(),
    "llama4_json": Llama3JsonParser(),
    "mistral": MistralParser(),
    "pythonic": PythonicParser(),
    "gemma3": GemmaParser(),  # not a vLLM name: vLLM reads Gemma 3's calls with pythonic and a custom template
    "qwen3_coder": QWEN3_XML,
    "qwen3_xml": QWEN3_XML,
    "openai": HARMONY,
}
PARSER_CHOICES = ("auto", *sorted(TOOL_CALL_PARSERS))


def tool_call_parser(name: str | ToolParser | None) -> ToolParser | None:
    """The parser registered under `name`; None for "auto" (picked from each chat template, `pick_parser`);
    ConfigError for an unknown name."""
    if name is None or name == "auto":
        return None
    if isinstance(name, ToolParser):
        return name
    parser = TOOL_CALL_PARSERS.get(name) if isinstance(name, str) else None
    if parser is None:
        raise ConfigError(f"unknown tool call parser {name!r}; choices: {list(PARSER_CHOICES)}")
    return parser


_LLAMA_JSON = re.compile(r'"parameters": dictionary of argument name|respond with a JSON for a function call',
                         re.IGNORECASE)


def pick_parser(template: str) -> ToolParser:
    """The parser for the format a chat template that renders tools teaches (`--tool-call-parser auto`)."""
    if "<|channel|>" in template:  # gpt-oss's harmony channels
        return HARMONY
    if "<function=" in template:  # Qwen3-Coder / Qwen3.5 XML calls (their templates also write <tool_call>)
        return QWEN3_XML
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return TOOL_CALL_PARSERS["mistral"]
    if "[func_name1(" in template:  # Llama 3.2 / 4 pythonic templates spell the format out so
        return TOOL_CALL_PARSERS["pythonic"]
    if "tool_code" in template:  # Gemma 3's tool-use prompts: calls in a ```tool_code block
        return TOOL_CALL_PARSERS["gemma3"]
    if "<|python_tag|>" in template or _LLAMA_JSON.search(template):
        return TOOL_CALL_PARSERS["llama3_json"]
    return HERMES
