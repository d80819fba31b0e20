"""One chat call prepared, the same way for the in-process API (`Runtime.chat`, `chat_stream`) and the
server's chat routes (OpenAI's chat completions, Responses, Anthropic's Messages): the plan (tools, tool
choice, output grammar, reasoning) fitted to the chat template, the prompt rendered and tokenized, and the
grammar compiled, the prompt cut (vLLM's truncate_prompt_tokens) and the sampling parameters built, all in
one worker thread so the event loop never waits on them.

    prepared = await runtime.prepare_chat(messages, tools=specs, output=constraint, program_id=pid,
                                          sampling=lambda prompt_len, constraint: SamplingParams(...))
    prepared.plan, prepared.prompt_ids, prepared.params

`merge_sampling` is the one rule sampling arguments are layered by: the model's generation defaults, then
a server's defaults, then the call's own arguments; each layer holds only what it sets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentrt._chat_plan import ChatPlan, plan_call
from agentrt._errors import InvalidCallError
from agentrt._reasoning import ThinkTagParser
from agentrt.engine import SamplingParams
from agentrt.engine.sampling_params import truncate_prompt
from agentrt.engine.structured import Constraint

# The sampling parameters of a prepared call, from its prompt's length (after any cut) and its output grammar.
SamplingFor = Callable[[int, Constraint | None], SamplingParams]


@dataclass(slots=True)
class PreparedCall:
    """A chat call ready to submit."""

    plan: ChatPlan  # splits the reply (reasoning, content, calls); its constraint is the output grammar
    prompt_ids: list[int]  # the prompt's token ids, cut to `truncate_prompt_tokens` when one was given
    prompt_text: str  # the prompt as the chat template rendered it
    params: SamplingParams | None = None  # what `sampling` built (None without one)


class ChatRuntime(Protocol):
    """What preparing a chat call needs of the runtime (agentrt._runtime.Runtime)."""

    reasoning: ThinkTagParser | None

    def plan_template(self, plan: ChatPlan, chat_template: str | None = None) -> ChatPlan: ...

    def chat_prompt(self, messages: Sequence[dict[str, Any]], program_id: str | None = None,
                    **options: Any) -> tuple[str, list[int]]: ...

    def tag_ids(self, tag: str) -> list[int]: ...

    def compile_constraint(self, constraint: Constraint, param: str | None = None) -> None: ...

    @property
    def max_model_len(self) -> int: ...


def prepare_chat(
    rt: ChatRuntime, messages: Any, *, tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
    output: Constraint | None = None, output_param: str = "response_format", program_id: str | None = None,
    tools_when_none: bool = True, truncate_prompt_tokens: int | None = None, sampling: SamplingFor | None = None,
    **options: Any,
) -> PreparedCall:
    """Blocking (`Runtime.prepare_chat` runs it in a worker thread). `tools`: OpenAI function specs;
    `output`: the output grammar a response format asks, a bad one a 400 naming `output_param`;
    `tools_when_none`: the prompt still shows the tools when tool_choice is "none"; `options`: the chat
    template's (agentrt._chat_prompt); `truncate_prompt_tokens`: keep the prompt's last k tokens (vLLM's);
    `sampling`: builds the call's SamplingParams (its errors propagate). Bad input raises InvalidCallError
    naming the argument."""
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
    if truncate_prompt_tokens is not None:
        try:
            ids = truncate_prompt(ids, truncate_prompt_tokens, rt.max_model_len)
        except ValueError as e:
            raise InvalidCallError(str(e), param="truncate_prompt_tokens") from None
    params = sampling(len(ids), plan.constraint) if sampling is not None else None
    if params is not None and plan.special_tokens:
        params.skip_special_tokens = False  # the format's markup is special tokens: the plan reads them
    return PreparedCall(plan, ids, text, params)


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
