"""gpt-oss's harmony format read out of its output (vLLM's `--tool-call-parser openai` and
`--reasoning-parser openai_gptoss`): reasoning, the answer and tool calls, from the text with its
special tokens kept (the plan decodes a harmony output with skip_special_tokens off).

The prompt ends with `<|start|>assistant`; the output is messages, each a header, `<|message|>`, a body
and `<|end|>` (`<|call|>` after a call, `<|return|>` after the answer: stop tokens, so the text lacks them):

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}
    <|start|>assistant<|channel|>final<|message|>It is sunny.

A header names the channel and may address the message to a recipient, after the channel or after the
role (`<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>`; at the output's
start ` to=functions.f<|channel|>...`). Where each message goes:

- addressed `to=functions.NAME` of a tool the call may use: a tool call, its body the JSON arguments,
  in any channel (gpt-oss writes some in analysis);
- addressed to anything else (built-in tools such as `browser.search` or `python`, an unknown function,
  or a call whose body is not a JSON object): reasoning, the model's own acts;
- the analysis channel: reasoning;
- the final channel, commentary without a recipient (a preamble), a message without a channel, or text
  outside any message: content.

Bodies of one kind are joined with a newline. A message cut short (no end token) is read as far as it
goes; a header cut short is dropped. Markup never reaches the content or the reasoning. `HarmonyReader`
does the reading for a whole output and for a stream alike: text is released once no special token can
be starting in it, and the pieces of a stream add up to what the whole output gives.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from agentrt._callparse import DECODER, ToolParser, partial_end
from agentrt._toolcalls import FunctionTool, ToolCall, new_call_id

START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN = (
    "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
TOKENS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
_TOKEN = re.compile("|".join(re.escape(t) for t in TOKENS))
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_TO = "to="


class HarmonyReader:
    """Reads one output's messages from its text, whole or in pieces: `feed` gives the (reasoning, content)
    known so far, `finish` the rest and the calls."""

    def __init__(self, names: set[str], new_id: Callable[[], str] = new_call_id) -> None:
        self.names = names  # the tools a call may use; an empty set: no call is read
        self.new_id = new_id
        self.held = ""  # text not read yet: what may be the start of a special token
        self.header: str | None = ""  # the header so far; None while in a body
        self.role = False  # the header began with <|start|>: a role comes first, the header is no text
        self.kind = ""  # the body's destination: "reasoning" | "content" | "call"
        self.recipient = ""  # a call's function name
        self.body = ""  # a call's body so far
        self.shown = {"reasoning": False, "content": False}  # some text of that kind is out
        self.fresh = True  # the body has shown nothing yet (a later body of the kind opens with a newline)
        self.calls: list[ToolCall] = []
        self.out = {"reasoning": [], "content": []}

    def feed(self, text: str) -> tuple[str, str]:
        buf, self.held = self.held + text, ""
        pos = 0
        for m in _TOKEN.finditer(buf):
            self._text(buf[pos:m.start()])
            self._token(m.group())
            pos = m.end()
        tail = buf[pos:]
        keep = max(partial_end(tail, t) for t in TOKENS)
        self._text(tail[: len(tail) - keep])
        self.held = tail[len(tail) - keep:]
        return self._take()

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        held, self.held = self.held, ""
        self._text(held)
        if self.header is None:
            self._close()
        elif self.header.strip() and not self.role and _TOKEN.search(self.header) is None:
            self._bare(self.header)
        self.header = ""
        reasoning, content = self._take()
        return reasoning, content, self.calls

    def _take(self) -> tuple[str, str]:
        reasoning, content = "".join(self.out["reasoning"]), "".join(self.out["content"])
        self.out = {"reasoning": [], "content": []}
        return reasoning, content

    def _emit(self, kind: str, text: str) -> None:
        if not text:
            return
        if self.fresh and self.shown[kind]:
            self.out[kind].append("\n")
        self.out[kind].append(text)
        self.shown[kind], self.fresh = True, False

    def _bare(self, text: str) -> None:
        """Text outside any message (a header it never was): content, a message of its own."""
        self.fresh = True
        self._emit("content", text)

    def _text(self, text: str) -> None:
        if not text:
            return
        if self.header is None:  # a body
            if self.kind == "call":
                self.body += text
            else:
                self._emit(self.kind, text)
            return
        self.header += text
        head = self.header.lstrip()
        if not self.role and _TOKEN.search(self.header) is None and head and not (
                head.startswith(_TO) or _TO.startswith(head)):  # text outside any message: content
            text, self.header = self.header, ""
            self._open("content")
            self._emit("content", text)

    def _token(self, token: str) -> None:
        if self.header is None:  # in a body: an end token, or a header where an end token was missing
            if token in (MESSAGE, CONSTRAIN):
                return  # markup inside a body: dropped
            self._close()
            self.header, self.role = (CHANNEL if token == CHANNEL else ""), token == START
            return
        if token == MESSAGE:
            self._open(self._kind(self.header))
        elif token in (CHANNEL, CONSTRAIN):
            self.header += token
        else:  # START, END, CALL, RETURN with no message begun: what came before was no header
            if self.header.strip() and not self.role and _TOKEN.search(self.header) is None:
                self._bare(self.header)
            self.header, self.role = "", token == START

    def _kind(self, header: str) -> str:
        to = _RECIPIENT.search(header)
        if to is not None:
            name = to.group(1).removeprefix("functions.")
            if to.group(1).startswith("functions.") and name in self.names:
                self.recipient = name
                return "call"
            return "reasoning"
        channel = _CHANNEL.search(header)
        return "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"

    def _open(self, kind: str) -> None:
        self.header, self.kind, self.body, self.fresh = None, kind, "", True

    def _close(self) -> None:
        if self.kind == "call":
            call = self._call(self.body)
            if call is not None:
                self.calls.append(call)
            else:
                self._emit("reasoning", self.body)  # not a call after all: the model's own act
        self.kind, self.body = "", ""

    def _call(self, body: str) -> ToolCall | None:
        text = body.strip()
        if not text:
            return ToolCall(self.new_id(), self.recipient, "{}")
        try:
            args, _ = DECODER.raw_decode(text)
        except ValueError:
            return None
        return ToolCall(self.new_id(), self.recipient, json.dumps(args)) if isinstance(args, dict) else None


class HarmonyParser(ToolParser):
    """The harmony format as a tool-call parser: `split` reads reasoning, content and calls of a finished
    output, `reader` a streamed one (ChatPlan uses them for the whole output, reasoning included)."""

    name = "openai"
    markers = (CHANNEL, START)
    special_tokens = True

    def reader(self, tools: list[FunctionTool]) -> HarmonyReader:
        return HarmonyReader({t.name for t in tools}, self.new_id)

    def split(self, text: str, tools: list[FunctionTool]) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, calls) of a finished output; None: none of that kind."""
        r = self.reader(tools)
        r1, c1 = r.feed(text)
        r2, c2, calls = r.finish()
        return (r1 + r2) or None, (c1 + c2) or None, calls

    def parse(self, text: str, tools: list[FunctionTool]) -> tuple[str | None, list[ToolCall]]:
        _, content, calls = self.split(text, tools)
        return content, calls


HARMONY = HarmonyParser()
