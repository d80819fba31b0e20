"""Reasoning outputs, as vLLM's `--reasoning-parser` gives them: the thinking apart from the answer.

Reasoning models (Qwen3, DeepSeek-R1 distills, QwQ) think inside `<think> ... </think>` before they
answer. Chat templates open that block in one of two ways, and a parser handles both alike:

- the prompt opens it: DeepSeek-R1's and Qwen3.5-style templates end the generation prompt with
  `<think>\\n`, so the output starts inside the block and only closes it;
- the model opens it: the original Qwen3 writes `<think>` itself as its first token.

A prompt that closes the block (`enable_thinking=False` renders `<think>\\n\\n</think>\\n\\n`) leaves
the output all answer. The rule: the output starts in reasoning iff the prompt ends inside an open
block; an output that starts (after whitespace) with `<think>` enters reasoning; reasoning lasts until
`</think>`; the rest is the content, its leading whitespace dropped. An output cut short inside the
block is all reasoning (no content). Tool calls are parsed from the content only.

    parser = reasoning_parser("qwen3")
    parser.split("<think>\\nhmm\\n</think>\\n\\nHi!", thinking=False)   # ("\\nhmm\\n", "Hi!")
"""

from __future__ import annotations

from dataclasses import dataclass

from agentrt._errors import ConfigError


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that could be the start of `tag` (held back when streaming)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class ReasoningStreamer:
    """Splits a stream of text into (reasoning, content) pieces as `ThinkTagParser.split` splits the
    whole text: no piece ever holds part of a tag, so a tag split across pieces is held back until it
    is known to be one (or not)."""

    def __init__(self, start: str, end: str, thinking: bool) -> None:
        self.start, self.end = start, end  # the tags that open and close the block
        self.thinking = thinking  # the prompt left a block open: the output starts in reasoning
        self.state = "head"  # "head" (an opening tag may come) | "reasoning" | "gap" (after the end tag) | "content"
        self.entered = thinking  # some of the output was in a think block
        self.held = ""  # text not shown yet: leading whitespace, or what may be the start of a tag

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) to show now for the next piece of the output."""
        buf, self.held = self.held + text, ""
        reasoning, content = [], []
        while buf:
            if self.state == "head":
                body = buf.lstrip()
                if body.startswith(self.start):
                    self.state, self.entered, buf = "reasoning", True, body[len(self.start):]
                elif not body or self.start.startswith(body):  # whitespace, or an opening tag in the making
                    self.held, buf = buf, ""
                else:
                    self.state = "reasoning" if self.thinking else "content"
            elif self.state == "reasoning":
                i = buf.find(self.end)
                if i >= 0:
                    reasoning.append(buf[:i])
                    self.state, buf = "gap", buf[i + len(self.end):]
                else:
                    keep = _partial_tag(buf, self.end)
                    reasoning.append(buf[: len(buf) - keep])
                    self.held, buf = buf[len(buf) - keep:], ""
            elif self.state == "gap":  # the whitespace between the block and the answer is dropped
                buf = buf.lstrip()
                if buf:
                    self.state = "content"
            else:
                content.append(buf)
                buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) held back when the output ends: a tag that never completed is text."""
        held, self.held = self.held, ""
        if self.state == "head":
            return (held, "") if self.thinking else ("", held)
        return (held, "") if self.state == "reasoning" else ("", held)


@dataclass(frozen=True, slots=True)
class ThinkTagParser:
    """Reasoning inside a think block (`<think> ... </think>` by default): vLLM's `deepseek_r1` and
    `qwen3` parsers, which differ only in which template style they expect; this one takes both."""

    name: str = "think"
    start: str = "<think>"
    end: str = "</think>"
    channels: bool = False  # gpt-oss's harmony channels, not a think block: ChatPlan reads the output whole

    def prompt_thinking(self, prompt: str) -> bool:
        """Whether a rendered prompt ends inside an open think block, so its output starts in reasoning."""
        return prompt.rfind(self.start) > prompt.rfind(self.end)

    def streamer(self, thinking: bool) -> ReasoningStreamer:
        """A splitter of a streamed output; `thinking`: the prompt left a block open (`prompt_thinking`)."""
        return ReasoningStreamer(self.start, self.end, thinking)

    def split(self, text: str, thinking: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output. Reasoning is None when there was none; content is
        None when the output has a think block and nothing after it (cut short, or no answer), else
        the text after the block (the whole text when there is no block)."""
        s = self.streamer(thinking)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        reasoning, content = r1 + r2, c1 + c2
        return reasoning or None, (content or None) if s.entered else content


REASONING_PARSERS: dict[str, ThinkTagParser] = {  # vLLM's --reasoning-parser names
    "deepseek_r1": ThinkTagParser("deepseek_r1"),
    "qwen3": ThinkTagParser("qwen3"),
    # gpt-oss: the analysis channel is the reasoning (agentrt._harmony reads the whole output)
    "openai_gptoss": ThinkTagParser("openai_gptoss", "<|channel|>analysis<|message|>", "<|end|>", channels=True),
}


def reasoning_parser(name: str | ThinkTagParser | None) -> ThinkTagParser | None:
    """The parser registered under `name` (None: no reasoning parsing); ConfigError for an unknown name."""
    if name is None or isinstance(name, ThinkTagParser):
        return name
    parser = REASONING_PARSERS.get(name) if isinstance(name, str) else None
    if parser is None:
        raise ConfigError(f"unknown reasoning parser {name!r}; choices: {sorted(REASONING_PARSERS)}")
    return parser
