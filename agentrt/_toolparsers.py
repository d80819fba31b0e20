"""Tool-call parsers, as vLLM's `--tool-call-parser` names them: the calls a model writes in the format it
was trained on, read out of its text.

    hermes        <tool_call>{"name": "f", "arguments": {...}}</tool_call>, any number, text around them
                  (Qwen2.5, Qwen3, Hermes; and our own prompt for templates that know no tools)
    llama3_json   {"name": "f", "parameters": {...}}; {"name": "g", ...}   (Llama 3.1 / 3.2 / 4 JSON), at the
                  start of the output or after <|python_tag|>
    mistral       [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]   or [TOOL_CALLS]f[ARGS]{...}
    pythonic      [f(city="Paris"), g(x=1)]   (Llama 3.2 / 4 pythonic), the whole output

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

from agentrt._errors import ConfigError
from agentrt._toolcalls import FunctionTool, ToolCall, call_from, new_call_id

_DECODER = json.JSONDecoder()


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of `text` that could be the start of `marker`."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class ToolParser:
    """Reads calls out of a model's output; subclasses say where calls start and how they read."""

    name = ""
    markers: tuple[str, ...] = ()  # a call starts wherever one of these is
    openers: tuple[str, ...] = ()  # ... or where the output begins with one of these (after whitespace)

    def new_id(self) -> str:
        return new_call_id()

    def start(self, text: str) -> int:
        """Where the first call may start in `text`; -1: nowhere."""
        body = text.lstrip()
        if body.startswith(self.openers + self.markers):
            return len(text) - len(body)
        return min((i for m in self.markers if (i := text.find(m)) >= 0), default=-1)

    def read(self, text: str, pos: int, names: set[str]) -> tuple[list[ToolCall], int] | None:
        """The calls written from `pos` (where a call starts) and where they end; None: they do not parse."""
        raise NotImplementedError

    def extract(self, text: str, tools: list[FunctionTool]) -> tuple[str, list[ToolCall]]:
        """(the text around the calls, as written; the calls)."""
        pos = self.start(text)
        got = self.read(text, pos, {t.name for t in tools}) if pos >= 0 else None
        if not got or not got[0]:
            return text, []
        calls, end = got
        return text[:pos] + text[end:], calls

    def parse(self, text: str, tools: list[FunctionTool]) -> tuple[str | None, list[ToolCall]]:
        """(content without the calls, calls) of a finished output. Without calls the content is the text."""
        kept, calls = self.extract(text, tools)
        content = kept.strip() if calls else text
        return (content or None), calls

    def streamer(self) -> CallStreamer:
        return CallStreamer(self)


class CallStreamer:
    """Splits a stream of content into text to show now and text held back: leading whitespace, what may
    be the start of a marker, and from where a call starts on, everything. `finish` says what of the held
    text is content and which calls it holds, as the parser's `parse` would for the whole."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.held = ""  # text not shown yet
        self.in_call = False  # a call has started: everything from here on is held
        self.head = True  # nothing but whitespace shown yet: an opener may still come

    def feed(self, text: str) -> str:
        if self.in_call:
            self.held += text
            return ""
        buf, self.held = self.held + text, ""
        starts = self.parser.openers + self.parser.markers
        if self.head:
            body = buf.lstrip()
            if body.startswith(starts):
                self.in_call, self.held = True, buf
                return ""
            if not body or any(s.startswith(body) for s in starts):
                self.held = buf
                return ""
            self.head = False
        i = min((j for m in self.parser.markers if (j := buf.find(m)) >= 0), default=-1)
        if i >= 0:
            self.in_call, self.held = True, buf[i:]
            return buf[:i]
        keep = max((_partial(buf, m) for m in self.parser.markers), default=0)
        self.held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def finish(self, tools: list[FunctionTool]) -> tuple[str, list[ToolCall]]:
        """(content left to show, calls) when the output ends: held text that holds no call is content."""
        held, self.held = self.held, ""
        kept, calls = self.parser.extract(held, tools)
        if not calls:
            return held, []
        kept = kept.rstrip()
        return (kept.lstrip() if self.head else kept), calls


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
        pos = _skip_ws(text, pos)
        if text.startswith(self.markers[0], pos):
            pos += len(self.markers[0])
        calls: list[ToolCall] = []
        while True:
            try:
                obj, end = _DECODER.raw_decode(text, _skip_ws(text, pos))
            except ValueError:
                return None
            call = call_from(obj, names, self.new_id)
            if call is None:
                return None
            calls.append(call)
            pos = end
            after = _skip_ws(text, pos)
            if not text.startswith(";", after) or not text.startswith("{", _skip_ws(text, after + 1)):
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
            at = _skip_ws(text, pos)
            marked = text.startswith(self.markers[0], at)
            if marked:
                at += len(self.markers[0])
            elif calls:
                return calls, pos
            named = self._NAMED.match(text, at)
            try:
                if named:
                    args, end = _DECODER.raw_decode(text, _skip_ws(text, named.end()))
                    objs: Any = [{"name": named.group(1), "arguments": args}]
                else:
                    objs, end = _DECODER.raw_decode(text, _skip_ws(text, at))
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


HERMES = HermesParser()
TOOL_CALL_PARSERS: dict[str, ToolParser] = {  # vLLM's --tool-call-parser names
    "hermes": HERMES,
    "llama3_json": Llama3JsonParser(),
    "llama4_json": Llama3JsonParser(),
    "mistral": MistralParser(),
    "pythonic": PythonicParser(),
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
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return TOOL_CALL_PARSERS["mistral"]
    if "[func_name1(" in template:  # Llama 3.2 / 4 pythonic templates spell the format out so
        return TOOL_CALL_PARSERS["pythonic"]
    if "<|python_tag|>" in template or _LLAMA_JSON.search(template):
        return TOOL_CALL_PARSERS["llama3_json"]
    return HERMES
