"""A chat call's messages as the in-process API and `agentrt.connect` take them: OpenAI's message dicts, and
what the API hands out put back where it belongs, so a tool loop reads as it would with OpenAI's SDK:

    r = await agentrt.chat(messages, tools=[fn])
    calls = r.choices[0].tool_calls                                   # ToolCall objects
    messages.append({"role": "assistant", "content": r.choices[0].text, "tool_calls": calls})
    messages.extend(await agentrt.run_tool_calls(calls, [fn]))        # {"role": "tool", ...} dicts
    text = await agentrt.chat(messages)

A reply itself (`Result`, `Choice`) goes in as its assistant message (`Result.message()`), an SDK object with
`model_dump` as its dict. `chat_messages` checks them once, the same way on both sides, and gives plain OpenAI
dicts (JSON as `connect` sends them, the chat template's input in-process), as the server reads its requests
(agentrt.server.calls.message_dicts): "developer" is "system", text parts are joined, a missing content
(an assistant's that only calls tools) is "". Bad input raises InvalidCallError naming the field
(`messages[2].tool_calls[0].id`) and its value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentrt._errors import InvalidCallError
from agentrt._results import Choice, Result
from agentrt._toolcalls import shown, tool_call_of

ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles, as the server takes them
TEXT_PARTS = ("text", "input_text", "output_text")  # content parts that are text (the only ones a call reads)


def chat_messages(messages: Any, program_id: str | None = None) -> list[dict[str, Any]]:
    """The messages of a chat call as OpenAI dicts, checked; see the module docstring."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidCallError(f"messages must be a non-empty list of {{role, content}} dicts, got {shown(messages)}",
                               program_id=program_id, param="messages")
    return [_message(m, f"messages[{i}]", program_id) for i, m in enumerate(messages)]


def _message(m: Any, where: str, pid: str | None) -> dict[str, Any]:
    def bad(message: str, field: str = "") -> InvalidCallError:
        return InvalidCallError(message, program_id=pid, param=where + field)

    if isinstance(m, (Result, Choice)):
        m = m.message()
    elif callable(getattr(m, "model_dump", None)):  # an OpenAI SDK message
        m = m.model_dump(exclude_none=True)
    if not isinstance(m, dict):
        hint = ""
        if isinstance(getattr(m, "__self__", None), (Result, Choice)):
            hint = " (a reply's `message` is a method: append `reply.message()`, or the reply itself)"
        raise bad(f"{where} must be a message ({{'role': ..., 'content': ...}} or a reply agentrt.chat returned), "
                  f"got {shown(m)}{hint}")
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {shown(role)}", ".role")
    content = _content(m.get("content"), role, where, bad)
    out = {**m, "role": "system" if role == "developer" else role, "content": content}
    calls = m.get("tool_calls")
    if calls is not None:
        if isinstance(calls, (str, bytes, dict)) or not isinstance(calls, Sequence):
            raise bad(f"{where}.tool_calls must be a list of tool calls, got {shown(calls)}", ".tool_calls")
        out["tool_calls"] = [tool_call_of(c, f"{where}.tool_calls[{j}]", pid).to_dict() for j, c in enumerate(calls)]
        if not out["tool_calls"]:
            del out["tool_calls"]
    if role == "tool" and (not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]):
        raise bad(f"{where} is a tool result: it needs the tool_call_id of the call it answers (a str), got "
                  f"{shown(m.get('tool_call_id'))}", ".tool_call_id")
    if m.get("name") is not None and not isinstance(m["name"], str):
        raise bad(f"{where}.name must be a str, got {shown(m['name'])}", ".name")
    return out


def _content(content: Any, role: str, where: str, bad: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        if role != "assistant":  # only an assistant's turn may be calls alone
            raise bad(f"{where} needs a str 'content' (only an assistant's may leave it out), got None", ".content")
        return ""
    if isinstance(content, (list, tuple)):
        texts = []
        for k, part in enumerate(content):
            text = part.get("text") if isinstance(part, dict) and part.get("type") in TEXT_PARTS else None
            if not isinstance(text, str):
                raise bad(f"{where}.content[{k}] must be a text part ({{'type': 'text', 'text': ...}}), got "
                          f"{shown(part)}", f".content[{k}]")
            texts.append(text)
        return "".join(texts)
    hint = " (a reply: put its .text here, or append the reply itself as a message)" \
        if isinstance(content, (Result, Choice)) else ""
    raise bad(f"{where}.content must be a str or a list of text parts, got {shown(content)}{hint}", ".content")
