"""What chat completions and the Responses API share: messages, tools, a tool choice and an
output format made into one prompt and one grammar (`agentrt._toolcalls` does the runtime part;
this adds the off-loop tokenizing and compiling a server needs)."""

from __future__ import annotations

from typing import Any

import anyio

from agentrt._toolcalls import ChatPlan, plan_call
from agentrt.server.errors import bad_request
from engine.structured import Constraint


async def plan_chat(
    st: Any, messages: list[dict[str, Any]], *, tools: Any = None, tool_choice: Any = None,
    output: Constraint | None = None, program_id: str | None = None,
) -> tuple[ChatPlan, list[int]]:
    """The plan and the prompt's token ids; rendering, tokenizing and compiling the grammar (cached)
    run off the event loop. Bad input raises InvalidCallError naming the field."""
    rt = st.runtime
    plan = plan_call(tools, tool_choice, output)
    ids = await anyio.to_thread.run_sync(rt.chat_token_ids, plan.render(messages), program_id)
    if plan.constraint is not None:
        param = "tool_choice" if plan.forced_call else "response_format"
        await anyio.to_thread.run_sync(lambda: rt.compile_constraint(plan.constraint, param))
    return plan, ids


def message_dicts(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages (msgspec Structs) as dicts for `ChatPlan.render`; text parts joined."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            bad = [p.type for p in content if p.type not in ("text", "input_text", "output_text")]
            if bad:
                raise bad_request(f"message content part of type {bad[0]!r} is not supported (only text)",
                                  f"messages[{i}].content")
            content = "".join(p.text or "" for p in content)
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                               for c in m.tool_calls]
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request("a tool message needs tool_call_id", f"messages[{i}].tool_call_id")
        out.append(d)
    return out
