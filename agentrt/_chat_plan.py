"""How one chat call handles its prompt and its output: tools in the prompt as the chat template takes
them; the reasoning split off the output first (agentrt._reasoning), then tool calls parsed out of the
rest (agentrt._toolparsers), under the output's grammar if it has one.

    plan = plan_call(tools, tool_choice, output).use_template(template_source, tool_parser)
    messages, tools = plan.render(messages), plan.template_tools()    # for the chat template
    plan.think(reasoning_parser, prompt_text, tag_ids)   # tag_ids: the tokenizer's ids of a tag
    reasoning, content, calls = plan.split(output_text)        # a finished output
    s = plan.streamer(); s.feed(piece) -> (reasoning, content); s.finish() -> Reply   # a streamed one

Without a reasoning parser (the default) the whole output goes to the tool-call parsing. A template that
renders no tools gets ours in the system message and the Hermes parser reads the calls, unless a parser
is named (`--tool-call-parser`). A parser that reads calls inside the thinking (Qwen3-Coder's XML) reads
them in the reasoning too, the reasoning's calls first. gpt-oss's harmony format (the `openai` tool-call
parser, picked for its template, or the `openai_gptoss` reasoning parser) is read whole by
agentrt._harmony: reasoning, content and calls from one pass over the text, its special tokens kept
(`special_tokens`: the output is decoded with skip_special_tokens off).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from agentrt._chat_prompt import renders_tools
from agentrt._harmony import HARMONY, HarmonyParser
from agentrt._reasoning import ThinkTagParser
from agentrt._toolcalls import (
    FunctionTool,
    ToolCall,
    call_constraint,
    native_messages,
    normalize_tools,
    parse_forced,
    render_messages,
    tool_choice_of,
)
from agentrt._toolparsers import HERMES, ToolParser, pick_parser
from agentrt.engine.structured import Constraint


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
    native: bool = False  # the chat template renders tools: tools, calls and results go to it as they are
    parser: ToolParser = HERMES  # reads the calls out of the output (tool choice "auto")
    harmony: HarmonyParser | None = None  # the output is gpt-oss's harmony messages: read whole by this

    def use_template(self, template: str | None, parser: ToolParser | None = None) -> ChatPlan:
        """Fit the plan to the source of the chat template the prompt renders with: native tools when it
        renders them; the calls read by `parser`, or (None: `--tool-call-parser auto`) by the parser of
        the format the template teaches, Hermes when it renders no tools (ours, in the system message)."""
        self.native = renders_tools(template)
        self.parser = parser or (pick_parser(template or "") if self.native else HERMES)
        if isinstance(self.parser, HarmonyParser):
            self.harmony = self.parser
        return self

    @property
    def special_tokens(self) -> bool:
        """The output must be decoded with its special tokens: they are the format's markup."""
        return self.harmony is not None

    @property
    def splits(self) -> bool:
        """A plain chat reply is split too (reasoning apart, markup read), not only one with tools."""
        return self.reasoning is not None or self.harmony is not None

    def _free_calls(self) -> bool:
        """Calls are read out of the text (tool choice "auto", no forced call)."""
        return self.mode == "auto" and not self.forced_call

    def render(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages for the chat template: as they are (tool calls with parsed arguments) for a template
        that renders tools, else plain {role, content} with the tools and calls in our Hermes text."""
        return native_messages(messages) if self.native else render_messages(messages, self.tools)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the template's `tools` variable (OpenAI function specs); None: it gets none."""
        return [t.spec() for t in self.tools] if self.native and self.tools else None

    def think(self, parser: ThinkTagParser | None, prompt: str,
              tag_ids: Callable[[str], list[int]] | None = None) -> ChatPlan:
        """Split reasoning off the output with `parser` (None: no reasoning), given the rendered prompt
        text. When the prompt opens a think block, a grammar (a JSON output, a forced call, a regex) waits
        for the block's end (vLLM's structured outputs with a reasoning parser): the constraint starts after
        the end tag's token ids (`tag_ids`: the tokenizer's), and the reply is the thinking, then the
        grammar's output. Otherwise a forced call or a JSON output has no reasoning: its grammar makes it
        JSON from the first token; a regex or grammar output is parsed (it may spell a think block itself)."""
        if parser is None:
            return self
        if parser.channels:  # gpt-oss: the whole output is read as harmony messages, reasoning included
            self.harmony = self.harmony or HARMONY
            return self
        thinking = parser.prompt_thinking(prompt)
        if self.constraint is not None and thinking and tag_ids is not None and (end := tag_ids(parser.end)):
            self.constraint = dataclasses.replace(self.constraint, after=tuple(end))
            self.reasoning, self.thinking = parser, True
            return self
        json_output = self.constraint is not None and self.constraint.kind in ("json_schema", "json_object")
        if not self.forced_call and not json_output:
            self.reasoning, self.thinking = parser, thinking
        return self

    def split(self, text: str) -> Reply:
        """(reasoning, content, tool calls) of a finished output; calls come from the content (and from the
        reasoning, for a parser that reads calls there)."""
        if self.harmony is not None and not self.forced_call:
            return Reply(*self.harmony.split(text, self.tools if self.mode == "auto" else []))
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.split(text, self.thinking)
        early: list[ToolCall] = []
        if reasoning and self._free_calls() and self.parser.calls_in_reasoning:
            s = self.parser.streamer()  # as a stream reads it, so that both give the same reasoning
            shown = s.feed(reasoning)
            rest, early = s.finish(self.tools)
            reasoning = (shown + rest) or None
        if content is None:
            return Reply(reasoning, None, early)
        if self.forced_call:
            calls = parse_forced(content, self.tools)
            return Reply(reasoning, None if calls else content, calls)
        if self.mode == "auto":
            content, calls = self.parser.parse(content, self.tools)
            return Reply(reasoning, content, early + calls)
        return Reply(reasoning, content, [])

    def streamer(self) -> ReplyStreamer:
        return ReplyStreamer(self)


class ReplyStreamer:
    """Splits a streamed output as `ChatPlan.split` splits the whole: reasoning and content pieces to
    show as they come, content that may be a tool call held back, and the calls when the output ends."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.think = plan.reasoning.streamer(plan.thinking) if plan.reasoning is not None else None
        self.forced: str | None = "" if plan.forced_call else None  # a forced call: all of it, held to the end
        # the calls the model may write, read by the plan's parser; None: no call is parsed, all content shows
        self.calls = plan.parser.streamer() if plan._free_calls() else None
        # calls written inside the thinking (Qwen3-Coder's XML), read as the content's are
        self.think_calls = (plan.parser.streamer() if self.think is not None and self.calls is not None
                            and plan.parser.calls_in_reasoning else None)
        self.harmony = (plan.harmony.reader(plan.tools if plan._free_calls() else [])
                        if plan.harmony is not None and not plan.forced_call else None)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) to show now for the next piece of the output."""
        if self.harmony is not None:
            return self.harmony.feed(text)
        reasoning, content = self.think.feed(text) if self.think is not None else ("", text)
        if self.think_calls is not None:
            reasoning = self.think_calls.feed(reasoning)
        if self.forced is not None:
            self.forced += content
            return reasoning, ""
        if self.calls is not None:
            content = self.calls.feed(content)
        return reasoning, content

    def finish(self) -> Reply:
        """What is left when the output ends: reasoning and content held back (a partial tag; text that
        looked like a call but is not one; text after the calls; "" when nothing is), and the calls."""
        if self.harmony is not None:
            return Reply(*self.harmony.finish())
        reasoning, content = self.think.finish() if self.think is not None else ("", "")
        early: list[ToolCall] = []
        if self.think_calls is not None:
            reasoning = self.think_calls.feed(reasoning)
            rest, early = self.think_calls.finish(self.plan.tools)
            reasoning += rest
        if self.forced is not None:
            text = self.forced + content
            calls = parse_forced(text, self.plan.tools)
            return Reply(reasoning, "" if calls else text, calls)
        if self.calls is None:
            return Reply(reasoning, content, [])
        content = self.calls.feed(content)
        rest, calls = self.calls.finish(self.plan.tools)
        return Reply(reasoning, content + rest, early + calls)


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
