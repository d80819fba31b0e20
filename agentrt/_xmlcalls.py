"""Qwen3-Coder / Qwen3.5 tool calls (vLLM's `qwen3_coder` and `qwen3_xml` parsers): XML, one parameter
per tag, the value as raw text.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are typed by the tool's JSON schema: an "integer", "number", "boolean" or "null" parameter reads
its text as one, an "object" or "array" as JSON (a Python literal when it is not JSON), a "string" as it
is (one newline after the opening tag and one before the closing tag are the template's, not the value's);
a parameter the schema does not name, or a value that does not read as its type, stays a string. Calls
may come anywhere in the output, the `<tool_call>` wrapper may be missing, and a call cut short (no
`</parameter>`, `</function>` or `</tool_call>`) is read up to where the next one starts. The model writes
them inside its thinking too (`calls_in_reasoning`). A call of an unknown tool stays content.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from agentrt._callparse import ToolParser
from agentrt._toolcalls import FunctionTool, ToolCall

_FUNCTION = re.compile(r"<function=([^>\n]*)>")
_PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL)
_NEXT = re.compile(r"<function=|<tool_call>")  # where a call cut short ends at the latest
_CLOSE = re.compile(r"\s*</function>")
_WRAP_END = re.compile(r"\s*</tool_call>")


def _trim(value: str) -> str:
    """The value without the newline the template writes after the opening tag and before the closing one."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _as(kind: Any, text: str) -> tuple[bool, Any]:
    """(read, value): `text` read as a JSON schema type; (False, None) when it is not one."""
    s = text.strip()
    try:
        if kind == "string":
            return True, text
        if kind == "integer":
            return True, int(s)
        if kind == "number":
            value = float(s)
            return True, int(s) if re.fullmatch(r"-?\d+", s) else value
        if kind == "boolean" and s.lower() in ("true", "false"):
            return True, s.lower() == "true"
        if kind == "null" and s.lower() in ("null", "none"):
            return True, None
        if kind in ("object", "array"):
            try:
                value = json.loads(s)
            except ValueError:
                value = ast.literal_eval(s)
            if isinstance(value, dict if kind == "object" else list):
                return True, value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    return False, None


def typed(text: str, schema: Any) -> Any:
    """A parameter's text as its schema's type (a string when the schema says none that fits)."""
    if not isinstance(schema, dict):
        return text
    kinds = schema.get("type")
    kinds = list(kinds) if isinstance(kinds, list) else [kinds] if kinds else []
    for option in schema.get("anyOf", []) + schema.get("oneOf", []):
        if isinstance(option, dict) and isinstance(option.get("type"), str):
            kinds.append(option["type"])
    if not kinds and "enum" in schema:
        kinds = sorted({"string" if isinstance(v, str) else "number" if isinstance(v, (int, float)) else "null"
                        for v in schema["enum"]}, key=lambda k: k == "string")
    for kind in sorted(kinds, key=lambda k: k == "string"):  # a string reads anything: try it last
        ok, value = _as(kind, text)
        if ok:
            return value
    return text


class XmlParser(ToolParser):
    """`<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`, any number, text
    around them; each call on its own: one that names an unknown tool stays in the content."""

    name = "qwen3_coder"
    markers = ("<tool_call>", "<function=")
    calls_in_reasoning = True

    def extract(self, text: str, tools: list[FunctionTool]) -> tuple[str, list[ToolCall]]:
        by_name = {t.name: t for t in tools}
        calls: list[ToolCall] = []
        kept: list[str] = []
        pos = 0
        for m in _FUNCTION.finditer(text):
            if m.start() < pos:
                continue
            tool = by_name.get(m.group(1).strip())
            if tool is None:
                continue
            start = m.start()
            before = text.rfind("<tool_call>", pos, start)
            if before >= 0 and not text[before + len("<tool_call>"):start].strip():
                start = before
            body_end, end = self._end(text, m.end())
            props = tool.parameters.get("properties", {}) if isinstance(tool.parameters, dict) else {}
            args = {p.group(1).strip(): typed(_trim(p.group(2)), props.get(p.group(1).strip()))
                    for p in _PARAM.finditer(text, m.end(), body_end)}
            kept.append(text[pos:start])
            calls.append(ToolCall(self.new_id(), tool.name, json.dumps(args)))
            pos = end
        kept.append(text[pos:])
        return "".join(kept), calls

    def _end(self, text: str, pos: int) -> tuple[int, int]:
        """(where a call's parameters end, where its text ends) for a call whose name ends at `pos`."""
        close = text.find("</function>", pos)
        nxt = _NEXT.search(text, pos)
        if close < 0 or (nxt is not None and nxt.start() < close):  # cut short: up to the next call
            stop = nxt.start() if nxt is not None else len(text)
            return stop, stop
        end = close + len("</function>")
        wrap = _WRAP_END.match(text, end)
        return close, wrap.end() if wrap else end


QWEN3_XML = XmlParser()
