"""The errors agentrt raises. Every one names the offending value and the program / request it
concerns, so a user never has to read a stack trace to learn what was wrong.

    AgentrtError
    ├── ConfigError (ValueError)             a runtime or policy setting is out of range
    ├── InvalidCallError (ValueError)        bad arguments to chat / generate (messages, sampling)
    ├── NoRuntimeError (RuntimeError)        chat / generate / process_table outside a Runtime
    ├── ProgramNotFoundError (LookupError)   no program with that id in the process table
    ├── ProgramExistsError (ValueError)      starting a program under the id of a running one
    ├── UsageError (TypeError)               the API used wrongly (e.g. `@tool` on a plain function)
    └── CallError                            the engine could not complete a call
        ├── CallAbortedError                 the call was aborted (by `Runtime.abort_program`, shutdown, ...)
        └── CallFailedError                  the engine rejected it (e.g. it can never fit the KV cache)
"""

from __future__ import annotations


class AgentrtError(Exception):
    """Root of every error agentrt raises. `program_id` / `request_id` say what it concerns."""

    def __init__(self, message: str, *, program_id: str | None = None, request_id: str | None = None) -> None:
        where = [f"{k}={v!r}" for k, v in (("program", program_id), ("request", request_id)) if v is not None]
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.program_id = program_id
        self.request_id = request_id


class ConfigError(AgentrtError, ValueError):
    """A runtime or scheduling-policy setting is out of range."""


class InvalidCallError(AgentrtError, ValueError):
    """`chat` / `generate` got bad arguments: malformed messages or sampling parameters. `param`
    names the offending argument where one can be named (the HTTP API reports it)."""

    def __init__(self, message: str, *, program_id: str | None = None, request_id: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message, program_id=program_id, request_id=request_id)
        self.param = param


class NoRuntimeError(AgentrtError, RuntimeError):
    """An operation needs a running `agentrt.Runtime` and none is current."""


class ProgramNotFoundError(AgentrtError, LookupError):
    """The process table holds no program with the given id."""


class ProgramExistsError(AgentrtError, ValueError):
    """A program with that id is already running."""


class UsageError(AgentrtError, TypeError):
    """The agentrt API was used wrongly, e.g. `@agentrt.tool` on a function that is not async."""


class CallError(AgentrtError):
    """The engine could not complete an LLM call."""


class CallAbortedError(CallError):
    """The call was aborted before it finished."""


class CallFailedError(CallError):
    """The engine rejected the call (for instance, it can never fit the KV cache)."""
