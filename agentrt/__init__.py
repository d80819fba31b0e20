"""agentrt: run agent programs on an engine that knows which program every LLM call belongs to.

    @agentrt.program
    async def react(question: str) -> str:
        reply = await agentrt.chat([{"role": "user", "content": question}], max_tokens=64)
        ...

    agentrt.run(react, "why is the sky blue?", policy="plas")
"""

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
from agentrt.policies import ATLAS, MLFQ, PLAS
from agentrt._process_table import ProcessTable, ProgramInfo
from agentrt._program import current_program_id, gather, program
from agentrt._runtime import Runtime
from agentrt._api import beam_search, chat, chat_stream, generate, generate_stream, process_table, run
from agentrt._context import current_runtime
from agentrt._client import RemoteRuntime, connect
from agentrt._embed import embed
from agentrt._tool import tool
from agentrt._results import ChatReply, Choice, Chunk, Result, TokenLogprob, TopLogprob, Usage
from agentrt._toolcalls import ToolCall, function_spec, run_tool_calls

__all__ = [
    "ATLAS",
    "AgentrtError",
    "CallAbortedError",
    "CallError",
    "CallFailedError",
    "ChatReply",
    "Choice",
    "Chunk",
    "ConfigError",
    "InvalidCallError",
    "MLFQ",
    "NoRuntimeError",
    "PLAS",
    "ProcessTable",
    "ProgramExistsError",
    "ProgramInfo",
    "ProgramNotFoundError",
    "RemoteRuntime",
    "Result",
    "Runtime",
    "TokenLogprob",
    "ToolCall",
    "TopLogprob",
    "Usage",
    "UsageError",
    "beam_search",
    "chat",
    "chat_stream",
    "connect",
    "current_program_id",
    "current_runtime",
    "embed",
    "function_spec",
    "gather",
    "generate",
    "generate_stream",
    "process_table",
    "program",
    "run",
    "run_tool_calls",
    "tool",
]
