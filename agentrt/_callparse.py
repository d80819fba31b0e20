"""What every tool-call parser shares (agentrt._toolparsers names them): where a call may start in a
model's output, reading the calls out of a finished output, and a streamer that shows content as it comes
and holds back from where a call may be starting, so that a streamed output ends with the calls and the
content `parse` finds in the whole.

A call starts at one of the parser's `markers`, anywhere in the output, or at one of its `openers` when
the output begins with it (after whitespace). `parse` splits a finished output into content and calls;
what does not parse as calls of the given tools stays content, unchanged. A parser with
`calls_in_reasoning` also reads calls written inside the thinking (Qwen3-Coder / Qwen3.5 write them
before the think block closes); one with `special_tokens` needs them in the text (the output is decoded
with skip_special_tokens off).
"""

from __future__ import annotations

import json

from agentrt._toolcalls import FunctionTool, ToolCall, new_call_id

DECODER = json.JSONDecoder()


def partial_end(text: str, marker: str) -> int:
    """The length of the longest end of `text` that could be the start of `marker`."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class ToolParser:
    """Reads calls out of a model's output; subclasses say where calls start and how they read."""

    name = ""
    markers: tuple[str, ...] = ()  # a call starts wherever one of these is
    openers: tuple[str, ...] = ()  # ... or where the output begins with one of these (after whitespace)
    calls_in_reasoning = False  # calls written inside the thinking are calls too (ChatPlan reads them there)
    special_tokens = False  # the format's markers are special tokens: the text must keep them

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
        keep = max((partial_end(buf, m) for m in self.parser.markers), default=0)
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
