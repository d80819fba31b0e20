"""What `agentrt.chat` / `generate` return when a plain string cannot hold what was asked.

    text = await agentrt.chat(messages)                          # str: the simple case
    r = await agentrt.chat(messages, n=3, logprobs=True)         # Result
    [c.text for c in r.choices], r.usage.completion_tokens, r.choices[0].logprobs[0].logprob

With a reasoning parser (`Runtime(reasoning_parser="qwen3")`, or a server started with `--reasoning-parser`)
the text is the answer alone and each choice's `reasoning` holds the thinking before it.
The call returns a `Result` (OpenAI's shape: choices, usage) when it asks for more than one text:
n > 1, logprobs / top_logprobs, prompt_logprobs, tools / tool_choice / response_format, or
`full=True`. Streams follow the same rule: `str` pieces in the simple case, `Chunk`s (with the
choice `index`) otherwise. The same types come back in-process and through `agentrt.connect`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentrt._toolcalls import ToolCall

RESULT_FIELDS = ("n", "logprobs", "top_logprobs", "prompt_logprobs")  # sampling fields a str cannot carry


def wants_result(sampling: dict[str, Any], full: bool) -> bool:
    """Whether a call returns a `Result` (streams: `Chunk`s) rather than text."""
    return bool(full) or sampling.get("n", 1) not in (1, None) or bool(sampling.get("logprobs")) \
        or bool(sampling.get("top_logprobs")) or sampling.get("prompt_logprobs") is not None


@dataclass(slots=True)
class TopLogprob:
    token: str
    logprob: float
    token_id: int | None = None  # None through agentrt.connect (the server sends text)


@dataclass(slots=True)
class TokenLogprob:
    """One generated token: its text, log-prob (under the raw logits) and the top alternatives."""

    token: str
    logprob: float
    token_id: int | None = None
    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int  # over all choices
    cached_tokens: int = 0  # of the prompt tokens, those served from the prefix cache (OpenAI's
    # usage.prompt_tokens_details.cached_tokens): KV an earlier call of the program (or another) computed

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class Choice:
    index: int
    text: str | None  # None when the model only called tools
    finish_reason: str | None  # "stop" | "length" | "tool_calls"
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # per token, when logprobs / top_logprobs were asked
    token_ids: list[int] | None = None
    stop_reason: int | str | None = None  # what ended a "stop": the stop string or stop token id (None: EOS)
    reasoning: str | None = None  # the thinking before the answer (with a reasoning parser; agentrt._reasoning)

    @property
    def content(self) -> str | None:
        return self.text

    def message(self) -> dict[str, Any]:
        """The choice as an assistant message to append to the conversation (OpenAI's format; the
        reasoning stays out, as reasoning models' templates leave it out of earlier turns)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            msg["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        return msg


@dataclass(slots=True)
class Result:
    """Every choice of a call, with usage; the first choice's fields are also the result's own."""

    choices: list[Choice]
    usage: Usage | None = None
    prompt_logprobs: list[float | None] | None = None  # per prompt token (in-process, prompt_logprobs set)

    @property
    def text(self) -> str | None:
        return self.choices[0].text

    @property
    def content(self) -> str | None:
        return self.choices[0].text

    @property
    def reasoning(self) -> str | None:
        return self.choices[0].reasoning

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.choices[0].tool_calls

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    def message(self) -> dict[str, Any]:
        return self.choices[0].message()


ChatReply = Result  # the name `agentrt.chat(..., tools=...)` results had first


@dataclass(slots=True)
class Chunk:
    """A piece of a streamed call when it returns a `Result`: which choice it continues."""

    index: int
    text: str
    finish_reason: str | None = None  # set on the choice's last chunk
    logprobs: list[TokenLogprob] | None = None
    reasoning: str = ""  # with a reasoning parser: the piece of thinking (`text` is then the answer's)


def token_logprobs(text_of: Any, ids: list[int], lps: list[float] | None,
                   tops: list[list[tuple[int, float]]] | None) -> list[TokenLogprob] | None:
    """Engine log-probs as TokenLogprobs; `text_of(token id) -> str`."""
    if lps is None:
        return None
    out = []
    for i, (tok, lp) in enumerate(zip(ids, lps)):
        top = [TopLogprob(text_of(a), b, a) for a, b in (tops[i] if tops else [])]
        out.append(TokenLogprob(text_of(tok), lp, tok, top))
    return out


def remote_logprobs(data: dict[str, Any] | None) -> list[TokenLogprob] | None:
    """A chat choice's `logprobs` object from the server as TokenLogprobs."""
    if not data or data.get("content") is None:
        return None
    return [TokenLogprob(t["token"], t["logprob"], None,
                         [TopLogprob(a["token"], a["logprob"]) for a in t.get("top_logprobs") or []])
            for t in data["content"]]
