"""The module-level API: `agentrt.chat`, `generate`, their `_stream` forms and `process_table` act on the
current runtime (the one whose `async with` encloses the caller, in-process or `agentrt.connect`), as
calls of the current program; `agentrt.run` starts a runtime around one coroutine.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import anyio

from agentrt._context import current_runtime
from agentrt._process_table import ProcessTable
from agentrt._results import Chunk, Result
from agentrt._runtime import Runtime
from agentrt.engine import SchedulingPolicy

P = ParamSpec("P")
T = TypeVar("T")


def process_table() -> ProcessTable:
    """The current runtime's process table."""
    rt = current_runtime()
    assert rt is not None
    return rt.programs



async def chat(messages: Sequence[Any], **sampling: Any) -> str | Result:
    """Chat completion for the current program: the assistant's reply to `messages` (a str), or a
    `Result` with every choice, logprobs and usage when the call asks for more than a text (n > 1,
    logprobs, top_logprobs, prompt_logprobs, tools, tool_choice, response_format, full=True).
    `messages`: OpenAI's message dicts; a reply's `tool_calls` (ToolCall objects) go back in an assistant
    message as they are, and a reply (`Result` / `Choice`) as its assistant message (agentrt._messages).
    `sampling`: `engine.SamplingParams` fields (max_tokens, temperature, stop, seed, min_p, ...), and
    `model`: the name of a LoRA adapter the runtime serves (`Runtime(lora_modules=...)`), or of the base model
    (as `agentrt serve` names it, or its path; None: the base model)."""
    rt = current_runtime()
    assert rt is not None
    return await rt.chat(messages, **sampling)


async def generate(prompt: str | list[int], **sampling: Any) -> str | Result:
    """Plain completion of `prompt` (text or token ids) for the current program; a `Result` as for `chat`."""
    rt = current_runtime()
    assert rt is not None
    return await rt.generate(prompt, **sampling)


async def chat_stream(messages: Sequence[dict[str, Any]], **sampling: Any) -> AsyncIterator[str | Chunk]:
    """Like `chat`, yielding text deltas as they are generated (`Chunk`s, which carry their choice's
    index, when `chat` would return a `Result`)."""
    rt = current_runtime()
    assert rt is not None
    async with contextlib.aclosing(rt.chat_stream(messages, **sampling)) as gen:
        async for text in gen:
            yield text


async def generate_stream(prompt: str | list[int], **sampling: Any) -> AsyncIterator[str | Chunk]:
    """Like `generate`, yielding text deltas (or `Chunk`s, as `chat_stream`) as they are generated."""
    rt = current_runtime()
    assert rt is not None
    async with contextlib.aclosing(rt.generate_stream(prompt, **sampling)) as gen:
        async for text in gen:
            yield text


async def beam_search(prompt: str | list[int], *, beam_width: int, max_tokens: int, length_penalty: float = 1.0,
                      ignore_eos: bool = False, model: str | None = None) -> Result:
    """A beam search of `prompt` (text or token ids) as calls of the current program (vLLM's beam search:
    engine.beam_search): a `Result` whose choices are the `beam_width` best beams, best first."""
    rt = current_runtime()
    assert rt is not None
    return await rt.beam_search(prompt, beam_width=beam_width, max_tokens=max_tokens, length_penalty=length_penalty,
                                ignore_eos=ignore_eos, model=model)


def run(
    fn: Callable[P, Awaitable[T]],
    *args: Any,
    model: str | None = None,
    policy: str | SchedulingPolicy = "plas",
    backend: str = "asyncio",
    **engine_config: Any,
) -> T:
    """Start a `Runtime`, await `fn(*args)` inside it, shut down, return the result."""

    async def main() -> T:
        async with Runtime(model, policy, **engine_config):
            return await fn(*args)

    return anyio.run(main, backend=backend)

