"""One chat call prepared, the same way for the in-process API (`Runtime.chat`, `chat_stream`) and the
server's chat routes (OpenAI's chat completions, Responses, Anthropic's Messages): the plan (tools, tool
choice, output grammar, reasoning) fitted to the chat template, the prompt rendered and tokenized, and the
grammar compiled, all in one worker thread so the event loop never waits on them.

    prepared = await runtime.prepare_chat(messages, tools=specs, output=constraint, program_id=pid)
    params = SamplingParams(**merge_sampling(runtime.generation_defaults, server_defaults, request_args))

`merge_sampling` is the one rule sampling arguments are layered by: the model's generation defaults, then
a server's defaults, then the call's own arguments; each layer holds only what it sets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentrt._chat_plan import ChatPlan, plan_call
from agentrt._reasoning import ThinkTagParser
from agentrt.engine.structured import Constraint


@dataclass(slots=True)
class PreparedCall:
    """A chat call ready to submit."""

    plan: ChatPlan  # splits the reply (reasoning, content, calls); its constraint is the output grammar
    prompt_ids: list[int]  # the prompt's token ids, before any truncation
    prompt_text: str  # the prompt as the chat template rendered it


class ChatRuntime(Protocol):
    """What preparing a chat call needs of the runtime (agentrt._runtime.Runtime)."""

    reasoning: ThinkTagParser | None

    def plan_template(self, plan: ChatPlan, chat_template: str | None = None) -> ChatPlan: ...

    def chat_prompt(self, messages: Sequence[dict[str, Any]], program_id: str | None = None,
                    **options: Any) -> tuple[str, list[int]]: ...

    def tag_ids(self, tag: str) -> list[int]: ...

    def compile_constraint(self, constraint: Constraint, param: str | None = None) -> None: ...


def prepare_chat(
    rt: ChatRuntime, messages: Any, *, tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
    output: Constraint | None = None, output_param: str = "response_format", program_id: str | None = None,
    tools_when_none: bool = True, **options: Any,
) -> PreparedCall:
    """Blocking (`Runtime.prepare_chat` runs it in a worker thread). `tools`: OpenAI function specs;
    `output`: the output grammar a response format asks, a bad one a 400 naming `output_param`;
    `tools_when_none`: the prompt still shows the tools when tool_choice is "none"; `options`: the chat
    template's (agentrt._chat_prompt). Bad input raises InvalidCallError naming the argument."""
    plan = plan_call(tools, tool_choice, output)
    if plan.mode == "none" and not tools_when_none:
        plan.tools = []  # "none" parses no call: the tools served only the prompt
    rt.plan_template(plan, options.get("chat_template"))
    plain = tools is None and tool_choice is None and output is None
    rendered = _rendered(messages, plan) if plain else plan.render(list(messages))
    text, ids = rt.chat_prompt(rendered, program_id, tools=plan.template_tools(), **options)
    plan.think(rt.reasoning, text, rt.tag_ids)
    if plan.constraint is not None:
        rt.compile_constraint(plan.constraint, "tool_choice" if plan.forced_call else output_param)
    return PreparedCall(plan, ids, text)


def openai_names(sampling: dict[str, Any]) -> dict[str, Any]:
    """A call's sampling arguments with OpenAI's newer `max_completion_tokens` read as `max_tokens`
    (it wins when both are given, as on the server's chat route)."""
    if "max_completion_tokens" not in sampling:
        return sampling
    out = dict(sampling)
    value = out.pop("max_completion_tokens")
    if value is not None:
        out["max_tokens"] = value
    return out


def merge_sampling(generation: Mapping[str, Any], *layers: Mapping[str, Any]) -> dict[str, Any]:
    """SamplingParams arguments: the model's generation defaults (engine.generation_config), each layer
    over them in turn (a server's defaults, then the call's own); later wins."""
    merged = dict(generation)
    for layer in layers:
        merged.update(layer)
    return merged


def _rendered(messages: Any, plan: ChatPlan) -> Any:
    """Earlier tool calls and tool results in a conversation as the template reads them (`ChatPlan.render`);
    a conversation without any goes as given."""
    if isinstance(messages, (list, tuple)) and any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                                                   for m in messages):
        return plan.render(list(messages))
    return messages
