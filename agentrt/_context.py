"""The current runtime: a context variable that `Runtime` and `RemoteRuntime` set while entered,
and `Host`, what programs, tools and the module-level calls need of either.

It sits below both runtimes and `_program`, so neither runtime module and `_program` import
each other: `@program` registers with whatever `Host` is current.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from agentrt._errors import NoRuntimeError
from agentrt._process_table import ProcessTable, ProgramInfo, ProgramStatus


class Host(Protocol):
    """What `@program`, `@tool` and `agentrt.chat` / `generate` use of the current runtime."""

    programs: ProcessTable

    def program_started(self, info: ProgramInfo) -> None: ...

    def program_exited(self, handle: Any, state: ProgramStatus, error: str | None) -> None: ...  # a ProgramHandle

    async def program_settled(self, handle: Any) -> None: ...  # the ended program's record is final

    def tool_started(self, info: ProgramInfo | None, tool: str, ttl_s: float | None = None) -> None: ...

    async def chat(self, messages: Sequence[dict[str, Any]], **sampling: Any) -> str: ...

    async def generate(self, prompt: str | list[int], **sampling: Any) -> str: ...

    def chat_stream(self, messages: Sequence[dict[str, Any]], **sampling: Any) -> AsyncIterator[str]: ...

    def generate_stream(self, prompt: str | list[int], **sampling: Any) -> AsyncIterator[str]: ...


_runtime: contextvars.ContextVar[Host | None] = contextvars.ContextVar("agentrt_runtime", default=None)


def current_runtime(required: bool = True) -> Any:
    """The runtime entered in this context (`Runtime` or `RemoteRuntime`); None, or `NoRuntimeError`
    when `required`, outside any."""
    rt = _runtime.get()
    if rt is None and required:
        raise NoRuntimeError("no agentrt runtime is running: use `async with agentrt.Runtime(...)` or `agentrt.run(...)`")
    return rt
