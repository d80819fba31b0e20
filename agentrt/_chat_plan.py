"""How one chat call handles its output: the reasoning split off first (agentrt._reasoning), then
tool calls parsed out of the rest (agentrt._toolcalls), under the output's grammar if it has one.

    plan = plan_call(tools, tool_choice, output).think(parser, prompt_text)
    reasoning, content, calls = plan.split(output_text)        # a finished output
    s = plan.streamer(); s.feed(piece) -> (reasoning, content); s.finish() -> Reply   # a streamed one

Without a reasoning parser (the default) the whole output goes to the tool-call parsing, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from agentrt._reasoning import ThinkTagParser
from agentrt._toolcalls import (
    CallStreamer,
    FunctionTool,
    ToolCall,
    call_constraint,
    normalize_tools,
    parse_forced,
    parse_tool_calls,
    render_messages,
    tool_choice_of,
)
from engine.structured import Constraint


class Reply(NamedTuple):
    """A chat output split: the thinking, the answer, the calls it makes."""

    reasoning: str | None  # None: no reasoning (no parser, or the model did not think)
    content: str | None  # None: no answer (only calls, or cut short while thinking)
    tool_calls: list[ToolCall]


@dataclass(slots=True)
class ChatPlan:
    """How one chat call handles reasoning, tools and output formats."""

    tools: list[FunctionTool] = field(default_factory=list)
    mode: str = "none"  # tool choice: "none" | "auto" | "required"
    constraint: Constraint | None = None  # grammar of the output (a forced call, or a response format)
    forced_call: bool = False  # the output is a call object decoded under `constraint`
    reasoning: ThinkTagParser | None = None  # splits the thinking off the output; None: no reasoning parsing
    thinking: bool = False  # the prompt ends inside an open think block: the output starts in reasoning

    def render(self, messages: list[dict[str, Any]]) -> list[dict[str, str]]:
        return render_messages(messages, self.tools)

    def think(self, parser: ThinkTagParser | None, prompt: str) -> ChatPlan:
        """Split reasoning off the output with `parser` (None: no reasoning), given the rendered prompt
        text. A forced call or a JSON output has none: its grammar makes it JSON from the first token
        (were it parsed, a prompt that opened a think block would make all of it reasoning). A regex or
        grammar output is parsed: it may spell out a think block itself."""
        json_output = self.constraint is not None and self.constraint.kind in ("json_schema", "json_object")
        if parser is not None and not self.forced_call and not json_output:
            self.reasoning, self.thinking = parser, parser.prompt_thinking(prompt)
        return self

    def split(self, text: str) -> Reply:
        """(reasoning, content, tool calls) of a finished output; calls come from the content only."""
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.split(text, self.thinking)
        if content is None:
            return Reply(reasoning, None, [])
        if self.forced_call:
            calls = parse_forced(content, self.tools)
            return Reply(reasoning, None if calls else content, calls)
        if self.mode == "auto":
            return Reply(reasoning, *parse_tool_calls(content, self.tools))
        return Reply(reasoning, content, [])

    def streamer(self) -> ReplyStreamer:
        return ReplyStreamer(self)


class ReplyStreamer:
    """Splits a streamed output as `ChatPlan.split` splits the whole: reasoning and content pieces to
    show as they come, content that may be a tool call held back, and the calls when the output ends."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.think = plan.reasoning.streamer(plan.thinking) if plan.reasoning is not None else None
        self.calls: CallStreamer | None = None  # None: no call is parsed, all content shows
        if plan.forced_call:
            self.calls = CallStreamer()
            self.calls.in_call = True  # everything is the call
        elif plan.mode == "auto":
            self.calls = CallStreamer()
        self.text = ""  # the output so far (parsed for calls at the end)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) to show now for the next piece of the output."""
        reasoning, content = self.think.feed(text) if self.think is not None else ("", text)
        if self.calls is not None:
            self.text += text
            content = self.calls.feed(content)
        return reasoning, content

    def finish(self) -> Reply:
        """What is left when the output ends: reasoning and content held back (a partial tag; text that
        looked like a call but is not one; "" when nothing is), and the calls."""
        reasoning, content = self.think.finish() if self.think is not None else ("", "")
        if self.calls is None:
            return Reply(reasoning, content, [])
        content = self.calls.feed(content)
        calls = self.plan.split(self.text).tool_calls
        return Reply(reasoning, content if calls else content + self.calls.held, calls)


def plan_call(tools: Any = None, tool_choice: Any = None, output: Constraint | None = None,
              tools_param: str = "tools") -> ChatPlan:
    """Validate tools, the tool choice and the output format into a plan; InvalidCallError naming the
    bad argument otherwise."""
    specs = normalize_tools(tools, tools_param) if tools else []
    mode, name = tool_choice_of(tool_choice, specs)
    plan = ChatPlan(specs, mode, output)
    if mode == "required":  # the output is the call: a response format governs text, which it has none of
        plan.constraint, plan.forced_call = call_constraint(specs, name), True
    return plan
