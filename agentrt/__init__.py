"""agentrt: run agent programs on an engine that knows which program every LLM call belongs to.

    @agentrt.program
    async def react(question: str) -> str:
        reply = await agentrt.chat([{"role": "user", "content": question}], max_tokens=64)
        ...

    agentrt.run(react, "why is the sky blue?", policy="plas")

The package is also the import root of every floor (see docs/architecture.md):
`agentrt.kernels`, `agentrt.engine`, `agentrt.programs`, `agentrt.bench`, `agentrt.command`. Its
public names load on first use, so `import agentrt.engine` runs no runtime code (the engine and
kernels stay importable with torch, triton and transformers alone).
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

_EXPORTS = {
    "ATLAS": "agentrt.policies",
    "AgentrtError": "agentrt._errors",
    "CallAbortedError": "agentrt._errors",
    "CallError": "agentrt._errors",
    "CallFailedError": "agentrt._errors",
    "ChatReply": "agentrt._results",
    "Choice": "agentrt._results",
    "Chunk": "agentrt._results",
    "ConfigError": "agentrt._errors",
    "InvalidCallError": "agentrt._errors",
    "MLFQ": "agentrt.policies",
    "NoRuntimeError": "agentrt._errors",
    "PLAS": "agentrt.policies",
    "ProcessTable": "agentrt._process_table",
    "ProgramExistsError": "agentrt._errors",
    "ProgramInfo": "agentrt._process_table",
    "ProgramNotFoundError": "agentrt._errors",
    "RemoteRuntime": "agentrt._client",
    "Result": "agentrt._results",
    "Runtime": "agentrt._runtime",
    "RuntimeConfig": "agentrt._config",
    "TokenLogprob": "agentrt._results",
    "ToolCall": "agentrt._toolcalls",
    "TopLogprob": "agentrt._results",
    "Usage": "agentrt._results",
    "UsageError": "agentrt._errors",
    "beam_search": "agentrt._api",
    "chat": "agentrt._api",
    "chat_stream": "agentrt._api",
    "connect": "agentrt._client",
    "current_program_id": "agentrt._program",
    "current_runtime": "agentrt._context",
    "embed": "agentrt._embed",
    "function_spec": "agentrt._toolcalls",
    "gather": "agentrt._program",
    "generate": "agentrt._api",
    "generate_stream": "agentrt._api",
    "process_table": "agentrt._api",
    "program": "agentrt._program",
    "run": "agentrt._api",
    "run_tool_calls": "agentrt._toolcalls",
    "tool": "agentrt._tool",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentrt' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if _TYPE_CHECKING:  # the names for type checkers and IDEs
    from agentrt._api import beam_search, chat, chat_stream, generate, generate_stream, process_table, run
    from agentrt._client import RemoteRuntime, connect
    from agentrt._config import RuntimeConfig
    from agentrt._context import current_runtime
    from agentrt._embed import embed
    from agentrt._errors import (
        AgentrtError,
        CallAbortedError,
        CallError,
        CallFailedError,
        ConfigError,
        InvalidCallError,
        NoRuntimeError,
        ProgramExistsError,
        ProgramNotFoundError,
        UsageError,
    )
    from agentrt._process_table import ProcessTable, ProgramInfo
    from agentrt._program import current_program_id, gather, program
    from agentrt._results import ChatReply, Choice, Chunk, Result, TokenLogprob, TopLogprob, Usage
    from agentrt._runtime import Runtime
    from agentrt._tool import tool
    from agentrt._toolcalls import ToolCall, function_spec, run_tool_calls
    from agentrt.policies import ATLAS, MLFQ, PLAS
