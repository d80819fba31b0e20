"""Tool calling for any model: tools in the prompt, calls out of the text, forced calls by grammar.

When the chat template renders tools (its source uses `tools`, as Qwen's, Llama 3.1's and Mistral's do),
the tools, assistant tool calls and tool results go to it as they are (`native_messages`) and the calls
come out in the model's own format (agentrt._toolparsers). Otherwise (SmolLM2 among them) tools are
described in the system prompt in a Hermes-style format and the model calls one by writing

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`tool_choice="auto"` lets the model choose, and the calls it writes are parsed out of its text;
`"none"` keeps the tools in the prompt and parses nothing (the text is the content).
`"required"` or a named function forces a call by constrained decoding: the output is then a JSON
object `{"name": ..., "arguments": {...}}` matching one tool's parameter schema (exactly one call).
Assistant messages with `tool_calls` and `role: "tool"` results go back into the prompt in the
same format, so a conversation reads as the model would have written it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentrt._errors import InvalidCallError
from agentrt.engine.structured import Constraint

_NAME = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
OPEN, CLOSE = "<tool_call>", "</tool_call>"

TOOLS_PROMPT = """You can call functions to help with the request. They are described by these JSON schemas:
<tools>
{tools}
</tools>
To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> tags:
<tool_call>
{{"name": "function_name", "arguments": {{"arg": "value"}}}}
</tool_call>
Function results come back inside <tool_response></tool_response> tags."""


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object

    def spec(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(slots=True)
class ToolCall:
    """A call the model made: `arguments` is JSON text, as in OpenAI's API."""

    id: str
    name: str
    arguments: str

    @property
    def args(self) -> Any:
        return json.loads(self.arguments)

    def to_dict(self) -> dict[str, Any]:
        """The call as an entry of an assistant message's `tool_calls`, in OpenAI's format."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def shown(value: Any, limit: int = 120) -> str:
    """A value as an error message shows it: its type and a repr cut to `limit` characters."""
    text = repr(value)
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    name = type(value).__name__
    plain = text.startswith(name) or isinstance(value, (str, int, float, dict, list, tuple))
    return text if plain else f"{name} {text}"


def tool_call_of(obj: Any, where: str, program_id: str | None = None) -> ToolCall:
    """A call as a reply's `tool_calls` hands it out (`ToolCall`), in OpenAI's format (`{"id", "type": "function",
    "function": {"name", "arguments"}}`, also as an SDK object with `model_dump`), or flat (`{"id", "name",
    "arguments"}`); arguments as JSON text or an object. InvalidCallError naming `where` and the value otherwise."""
    if isinstance(obj, ToolCall):
        return obj
    data = obj.model_dump(exclude_none=True) if callable(getattr(obj, "model_dump", None)) else obj
    if not isinstance(data, dict):
        raise InvalidCallError(f"{where} must be a tool call (a ToolCall from a reply's tool_calls, or "
                               f"{{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}), got {shown(obj)}",
                               program_id=program_id, param=where)
    if data.get("type", "function") != "function":
        raise InvalidCallError(f"{where}.type must be 'function', got {shown(data.get('type'))}", program_id=program_id,
                               param=f"{where}.type")
    fn, at = (data["function"], f"{where}.function") if "function" in data else (data, where)
    if not isinstance(fn, dict):
        raise InvalidCallError(f"{at} must be an object with a name and arguments, got {shown(fn)}",
                               program_id=program_id, param=at)
    call_id, name, arguments = data.get("id"), fn.get("name"), fn.get("arguments")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidCallError(f"{where}.id must be the call's id (a non-empty str), got {shown(call_id)}",
                               program_id=program_id, param=f"{where}.id")
    if not isinstance(name, str) or not name:
        raise InvalidCallError(f"{at}.name must be a function name (a non-empty str), got {shown(name)}",
                               program_id=program_id, param=f"{at}.name")
    if arguments is None:
        arguments = "{}"
    elif not isinstance(arguments, str):
        try:
            arguments = json.dumps(arguments)
        except (TypeError, ValueError):
            raise InvalidCallError(f"{at}.arguments must be JSON text or a JSON object, got {shown(arguments)}",
                                   program_id=program_id, param=f"{at}.arguments") from None
    return ToolCall(call_id, name, arguments)


def _bad(message: str, param: str) -> InvalidCallError:
    return InvalidCallError(message, param=param)


def normalize_tools(tools: Any, param: str = "tools") -> list[FunctionTool]:
    """Chat-style (`{"type": "function", "function": {...}}`) or Responses-style (`{"type": "function",
    "name": ...}`) tool specs, checked; InvalidCallError naming the bad field otherwise."""
    if not isinstance(tools, list):
        raise _bad(f"{param} must be a list of function tools, got {type(tools).__name__}", param)
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise _bad(f"{where} must be a function tool ({{'type': 'function', ...}})", where)
        fn = t.get("function", t)
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{where} has a bad function name {name!r} (1-64 of a-z A-Z 0-9 _ -)", f"{where}.name")
        if name in seen:
            raise _bad(f"{where}: two tools are named {name!r}", f"{where}.name")
        seen.add(name)
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise _bad(f"{where}.description must be a string", f"{where}.description")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        check_schema(params, f"{where}.parameters")
        out.append(FunctionTool(name, desc, params))
    return out


def check_schema(schema: Any, param: str) -> None:
    """A JSON schema that jsonschema accepts; InvalidCallError naming `param` otherwise."""
    import jsonschema

    if not isinstance(schema, dict):
        raise _bad(f"{param} must be a JSON schema object, got {type(schema).__name__}", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise _bad(f"{param} is not a valid JSON schema: {e.message}", param) from None


def tool_choice_of(choice: Any, tools: list[FunctionTool], param: str = "tool_choice") -> tuple[str, str | None]:
    """("none" | "auto" | "required", forced function name or None)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise _bad("tool_choice 'required' needs tools", param)
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function", choice)
        name = fn.get("name") if isinstance(fn, dict) else None
        if not any(t.name == name for t in tools):
            raise _bad(f"tool_choice names the function {name!r}, which is not among the tools "
                       f"{[t.name for t in tools]}", param)
        return "required", name
    raise _bad(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
               f"{{'name': ...}}}}, got {choice!r}", param)


def call_constraint(tools: list[FunctionTool], name: str | None) -> Constraint:
    """The grammar a forced call is decoded under: one `{"name", "arguments"}` object of an allowed tool."""
    allowed = [t for t in tools if name is None or t.name == name]
    options = [
        {"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
         "required": ["name", "arguments"], "additionalProperties": False}
        for t in allowed
    ]
    return Constraint.json_schema(options[0] if len(options) == 1 else {"anyOf": options})


def render_messages(messages: list[dict[str, Any]], tools: list[FunctionTool]) -> list[dict[str, str]]:
    """Messages as plain {role, content} for a chat template without tool support: tools described in
    the system message, assistant tool calls and tool results written in the Hermes format.
    The tools are described whatever the tool choice, "none" included (as vLLM does by default): the
    model still knows what it has, and the calls of one conversation share their prompt's prefix, so a
    call that may not use a tool still finds the KV of the calls before it in the prefix cache."""
    out: list[dict[str, str]] = []
    for m in messages:
        if not isinstance(m, dict):
            out.append(m)  # the caller's validation names it
            continue
        role, content = m.get("role"), m.get("content")
        content = "" if content is None else content
        if role == "assistant" and m.get("tool_calls"):
            calls = [f"{OPEN}\n{json.dumps({'name': f['name'], 'arguments': _loads(f['arguments'])})}\n{CLOSE}"
                     for f in (c.get("function", c) for c in m["tool_calls"])]
            content = "\n".join([content, *calls]) if content else "\n".join(calls)
        elif role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        text = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.spec()["function"]) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def native_messages(messages: list[Any]) -> list[Any]:
    """Messages for a chat template that renders tools itself: an assistant's calls as OpenAI's `tool_calls`
    (`{"id", "type": "function", "function": {"name", "arguments"}}`, the arguments parsed into an object,
    which templates write with `tojson`), a tool result with its `tool_call_id` and, when known, the name of
    the function it answers. Other messages go as they are."""
    out: list[Any] = []
    names: dict[Any, str] = {}  # call id -> function name
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)  # the caller's validation names it
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                f = c.get("function", c) if isinstance(c, dict) else None
                if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                    raise _bad(f"messages[{i}].tool_calls[{j}] needs a function name, got {c!r}",
                               f"messages[{i}].tool_calls[{j}]")
                names[c.get("id")] = f["name"]
                calls.append({"id": c.get("id"), "type": "function",
                              "function": {"name": f["name"], "arguments": _loads(f.get("arguments") or {})}})
            out.append({**m, "content": m.get("content") or "", "tool_calls": calls})
        elif m.get("role") == "tool" and not m.get("name") and m.get("tool_call_id") in names:
            out.append({**m, "name": names[m["tool_call_id"]]})
        else:
            out.append(m)
    return out


def _loads(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def call_from(obj: Any, names: set[str], new_id: Callable[[], str] = new_call_id) -> ToolCall | None:
    """A call written as `{"name", "arguments" (or "parameters")}` of one of the tools `names`; None otherwise."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _loads(args)
    return ToolCall(new_id(), obj["name"], json.dumps(args))


def parse_forced(text: str, tools: list[FunctionTool]) -> list[ToolCall]:
    """The call a constrained decode wrote (empty when it was cut short, e.g. by max_tokens)."""
    try:
        call = call_from(json.loads(text), {t.name for t in tools})
    except ValueError:
        return []
    return [call] if call is not None else []


def response_format_constraint(fmt: Any, param: str = "response_format") -> Constraint | None:
    """OpenAI's `response_format` (or the Responses API's `text.format`) as a constraint."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad(f"{param} must be an object", param)
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema", fmt)  # chat nests it; Responses' text.format does not
        where = f"{param}.json_schema.schema" if "json_schema" in fmt else f"{param}.schema"
        schema = spec.get("schema") if isinstance(spec, dict) else None
        check_schema(schema, where)
        return Constraint.json_schema(schema)
    raise _bad(f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", f"{param}.type")


# --- the in-process API: replies with calls, tools from Python functions, running the calls ------
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


def _type_schema(tp: Any) -> dict[str, Any]:
    import types
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _JSON_TYPES:
        return {"type": _JSON_TYPES[tp]}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (list, tuple, set) or tp in (list, tuple, set):
        return {"type": "array", "items": _type_schema(args[0])} if args else {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return _type_schema(options[0]) if len(options) == 1 else {"anyOf": [_type_schema(a) for a in options]}
    return {}


def function_spec(fn: Any) -> dict[str, Any]:
    """A tool spec for an (`@agentrt.tool`) async function: its name, its docstring's first paragraph,
    and a JSON schema of its parameters from their type hints (a parameter with a default is optional)."""
    import inspect
    import typing

    target = inspect.unwrap(fn)
    name = getattr(fn, "tool_name", None) or target.__name__
    hints = typing.get_type_hints(target)
    props, required = {}, []
    for p in inspect.signature(target).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        props[p.name] = _type_schema(hints.get(p.name, Any))
        if p.default is p.empty:
            required.append(p.name)
    doc = inspect.getdoc(target) or ""
    return {"type": "function", "function": {
        "name": name, "description": doc.split("\n\n")[0].strip(),
        "parameters": {"type": "object", "properties": props, "required": required},
    }}


def tool_specs(tools: Any) -> Any:
    """Tools given as specs or as Python functions, all as specs."""
    if not isinstance(tools, (list, tuple)):
        return tools  # normalize_tools names the problem
    return [t if isinstance(t, dict) else function_spec(t) if callable(t) else t for t in tools]


async def run_tool_calls(calls: Any, tools: list[Any]) -> list[dict[str, Any]]:
    """Run the calls a reply made with the matching Python functions (async or not); one `role: "tool"`
    message per call, in order. `calls`: a reply's `tool_calls` (or the reply itself), the entries also as
    OpenAI's dicts (`tool_call_of`). A call that fails (unknown tool, bad arguments, an exception in the
    tool) gets its error as the message content: the model sees it, the program goes on."""
    import inspect

    calls = getattr(calls, "tool_calls", calls)  # a Result or Choice: its calls
    if isinstance(calls, (str, bytes, dict)) or not isinstance(calls, (list, tuple)):
        raise InvalidCallError(f"calls must be a reply's tool_calls (a list), got {shown(calls)}", param="calls")
    calls = [tool_call_of(c, f"calls[{i}]") for i, c in enumerate(calls)]
    by_name = {function_spec(t)["function"]["name"]: t for t in tools if callable(t)}
    out = []
    for c in calls:
        fn = by_name.get(c.name)
        try:
            if fn is None:
                raise LookupError(f"no tool named {c.name!r}")
            args = json.loads(c.arguments) if c.arguments else {}
            if not isinstance(args, dict):
                raise TypeError(f"arguments must be a JSON object, got {c.arguments!r}")
            result = fn(**args)
            if inspect.isawaitable(result):
                result = await result
            content = result if isinstance(result, str) else json.dumps(result, default=str)
        except Exception as e:  # noqa: BLE001 - the tool's error is the model's to see
            content = f"error: {type(e).__name__}: {e}"
        out.append({"role": "tool", "tool_call_id": c.id, "name": c.name, "content": content})
    return out
