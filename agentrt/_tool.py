"""`@agentrt.tool`: time each call of a tool and record it in the process table (per tool name,
per program), so the runtime learns how long programs sit in tools between LLM calls."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar, overload

from agentrt._context import current_runtime
from agentrt._errors import UsageError
from agentrt._program import _current

P = ParamSpec("P")
T = TypeVar("T")


def _record(tool_name: str, start: float) -> None:
    duration = time.monotonic() - start
    cur = _current.get()
    runtime = cur[0].runtime if cur is not None and cur[0].runtime is not None else current_runtime(required=False)
    if runtime is not None:
        runtime.programs.record_tool(cur[0].info if cur is not None else None, tool_name, duration)


def _started(tool_name: str, ttl: float | None) -> None:
    cur = _current.get()
    if cur is not None and cur[0].runtime is not None:
        cur[0].runtime.tool_started(cur[0].info, tool_name, ttl)


@overload
def tool(fn: Callable[P, Awaitable[T]], /) -> Callable[P, Coroutine[Any, Any, T]]: ...
@overload
def tool(
    *, name: str | None = None, ttl: float | None = None
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Coroutine[Any, Any, T]]]: ...


def tool(fn: Callable[P, Awaitable[T]] | None = None, /, *, name: str | None = None, ttl: float | None = None) -> Any:
    """Mark an async function as a tool: `@agentrt.tool` or `@agentrt.tool(name="search", ttl=5.0)`.

    Its duration (including failed or cancelled calls) goes to the process table under its name.
    While it runs, the calling program's KV stays pinned for the tool's TTL: `ttl` seconds if given,
    else the runtime's choice from the tool's observed durations (agentrt._retention).
    Outside a runtime it just runs.
    """
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 <= ttl < float("inf")):
        raise UsageError(f"@agentrt.tool(ttl=...) must be a finite number of seconds >= 0, got {ttl!r}")

    def decorate(f: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
        if not inspect.iscoroutinefunction(f):
            raise UsageError(f"@agentrt.tool needs an async function, got {f!r}")
        tool_name = name if name is not None else f.__name__

        @functools.wraps(f)
        async def run_tool(*args: P.args, **kwargs: P.kwargs) -> T:
            start = time.monotonic()
            _started(tool_name, ttl)
            try:
                return await f(*args, **kwargs)
            finally:
                _record(tool_name, start)

        run_tool.tool_name = tool_name  # type: ignore[attr-defined]  (its name as a chat tool)
        return run_tool

    if fn is not None:
        return decorate(fn)
    return decorate
