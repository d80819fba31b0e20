"""The runtime: an in-process engine, the process table, and the calls programs make.

    async with agentrt.Runtime(policy="plas") as rt:   # becomes the current runtime
        text = await agentrt.chat([{"role": "user", "content": "hi"}], max_tokens=32)

`chat` / `generate` find the runtime and the calling program through context variables. A call
made outside any program is a one-call program of its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import anyio

import agentrt.policies  # noqa: F401  (registers plas / atlas / mlfq with the engine)
from agentrt._errors import CallAbortedError, CallFailedError, ConfigError, InvalidCallError, NoRuntimeError
from agentrt._process_table import ProcessTable, ProgramStatus
from agentrt._program import ProgramHandle, current, enter_program, exit_program
from engine import AsyncEngine, EngineConfig, SamplingParams, SchedulingPolicy, make_policy
from engine.async_engine import EngineError
from engine.outputs import RequestOutput

P = ParamSpec("P")
T = TypeVar("T")

_runtime: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar("agentrt_runtime", default=None)


def current_runtime(required: bool = True) -> Runtime | None:
    rt = _runtime.get()
    if rt is None and required:
        raise NoRuntimeError("no agentrt runtime is running: use `async with agentrt.Runtime(...)` or `agentrt.run(...)`")
    return rt


def process_table() -> ProcessTable:
    """The current runtime's process table."""
    rt = current_runtime()
    assert rt is not None
    return rt.programs


class Runtime:
    """Owns an in-process `AsyncEngine` and the process table; an async context manager.

    Arguments:
        model: model directory or .gguf file; None = the default model.
        policy: scheduling policy name ("plas", "atlas", "mlfq", "fcfs") or a policy instance.
        policy_kwargs: arguments for a policy given by name (e.g. `{"beta": 4.0}`).
        **engine_config: any other `engine.EngineConfig` field (num_blocks, max_num_seqs, ...).
    """

    def __init__(
        self,
        model: str | None = None,
        policy: str | SchedulingPolicy = "plas",
        *,
        policy_kwargs: dict[str, Any] | None = None,
        **engine_config: Any,
    ) -> None:
        try:
            self.policy = make_policy(policy, **(policy_kwargs or {}))
            self.engine_config = EngineConfig(model=model, policy=self.policy, **engine_config)
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"bad runtime configuration: {e}") from None
        self.programs = ProcessTable()
        self.engine: AsyncEngine | None = None
        self._inflight: dict[str, set[str]] = {}  # program id -> request ids in the engine
        self._call_ids = itertools.count(1)
        self._token: contextvars.Token | None = None
        self._stack: contextlib.AsyncExitStack | None = None

    async def __aenter__(self) -> Runtime:
        stack = contextlib.AsyncExitStack()
        try:
            engine = AsyncEngine(self.engine_config)
            self.engine = await stack.enter_async_context(engine)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        self._token = _runtime.set(self)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._stack is not None and self._token is not None
        _runtime.reset(self._token)
        try:
            await self._stack.aclose()
        finally:
            self._stack = self._token = None

    @property
    def tokenizer(self) -> Any:
        return self._engine().tokenizer

    def kv_stats(self) -> Any:
        return self._engine().kv_stats()

    def _engine(self) -> AsyncEngine:
        if self.engine is None:
            raise NoRuntimeError("the runtime is not running: enter it with `async with`")
        return self.engine

    # --- programs ---------------------------------------------------------------------------
    def _end_program(self, handle: ProgramHandle, state: ProgramStatus, error: str | None) -> None:
        """Release everything the program holds: abort its calls still in flight, tell the policy."""
        pid = handle.program_id
        for rid in self._inflight.pop(pid, ()):
            if self.engine is not None:
                self.engine.abort(rid)
        end = getattr(self.policy, "end_program", None)
        if end is not None:
            end(pid)
        self.programs.end(handle.info, state, error)

    def abort_program(self, program_id: str) -> int:
        """Abort every in-flight call of a program (its awaiting `chat`s raise `CallAbortedError`)."""
        rids = self._inflight.get(program_id, set())
        for rid in list(rids):
            self._engine().abort(rid)
        return len(rids)

    # --- calls --------------------------------------------------------------------------------
    def chat_token_ids(self, messages: Sequence[dict[str, Any]], program_id: str | None = None) -> list[int]:
        """Token ids of `messages` under the model's chat template, ready for the assistant's turn."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise InvalidCallError(f"messages must be a non-empty list of {{role, content}} dicts, got {messages!r}", program_id=program_id)
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidCallError(f"each message needs a str 'role' and 'content', got {m!r}", program_id=program_id)
        tok = self.tokenizer
        text = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    async def _call(
        self, prompt: str | list[int], sampling: dict[str, Any], kind: str, out: list[RequestOutput]
    ) -> AsyncIterator[str]:
        """Run one LLM call for the current program (or as a one-call program); yield text deltas,
        append the final output to `out`."""
        engine = self._engine()
        cur = current()
        handle = None
        if cur is None:  # a one-call program; not made current, so nothing leaks to the consumer between deltas
            handle, _ = enter_program(kind, make_current=False)
            cur = (handle, f"{handle.program_id}.t0")
        prog, thread_id = cur
        pid = prog.program_id
        exc: BaseException | None = None
        try:
            params = _sampling_params(sampling, pid)
            rid = f"{pid}-c{next(self._call_ids)}"
            if isinstance(prompt, str):
                prompt = self.tokenizer(prompt)["input_ids"]
            try:
                stream = engine.add_request(prompt, params, request_id=rid, program_id=pid, thread_id=thread_id)
            except ValueError as e:
                raise InvalidCallError(str(e), program_id=pid, request_id=rid) from None
            self._inflight.setdefault(pid, set()).add(rid)
            call = self.programs.call_started(prog.info, rid, thread_id, len(prompt))
            result: RequestOutput | None = None
            generated = 0
            try:
                async for delta in stream:
                    if delta.new_token_ids:
                        generated += len(delta.new_token_ids)
                        self.programs.call_running(prog.info, call)
                    if delta.new_text:
                        yield delta.new_text
                result = await stream.result()
            except (ValueError, EngineError) as e:  # the engine rejected or failed the request
                raise CallFailedError(str(e), program_id=pid, request_id=rid) from None
            finally:
                inflight = self._inflight.get(pid)
                if inflight is not None:
                    inflight.discard(rid)
                    if not inflight:
                        del self._inflight[pid]
                if result is None:  # cancelled, closed early or failed: free its engine state now
                    engine.abort(rid)
                m = result.metrics if result is not None else None
                self.programs.call_done(
                    prog.info,
                    call,
                    service_s=m.service_s if m is not None else 0.0,
                    wait_s=_queue_wait(m),
                    num_output_tokens=generated,
                )
            if result.finish_reason == "abort":
                raise CallAbortedError("the call was aborted", program_id=pid, request_id=rid)
            if result.finish_reason == "error":
                raise CallFailedError(result.outputs[0].error or "the engine failed the call", program_id=pid, request_id=rid)
            out.append(result)
        except BaseException as e:
            exc = e
            raise
        finally:
            if handle is not None:
                exit_program(handle, None, exc)

    async def chat(self, messages: Sequence[dict[str, Any]], **sampling: Any) -> str:
        ids = self.chat_token_ids(messages, _pid())
        return await self._collect(ids, sampling, "chat")

    async def generate(self, prompt: str | list[int], **sampling: Any) -> str:
        return await self._collect(_check_prompt(prompt), sampling, "generate")

    async def chat_stream(self, messages: Sequence[dict[str, Any]], **sampling: Any) -> AsyncIterator[str]:
        ids = self.chat_token_ids(messages, _pid())
        async with contextlib.aclosing(self._call(ids, sampling, "chat", [])) as gen:
            async for text in gen:
                yield text

    async def generate_stream(self, prompt: str | list[int], **sampling: Any) -> AsyncIterator[str]:
        async with contextlib.aclosing(self._call(_check_prompt(prompt), sampling, "generate", [])) as gen:
            async for text in gen:
                yield text

    async def _collect(self, prompt: str | list[int], sampling: dict[str, Any], kind: str) -> str:
        out: list[RequestOutput] = []
        async with contextlib.aclosing(self._call(prompt, sampling, kind, out)) as gen:
            async for _ in gen:
                pass
        return out[0].text


def _pid() -> str | None:
    cur = current()
    return None if cur is None else cur[0].program_id


def _check_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    raise InvalidCallError(f"prompt must be a non-empty str or list of token ids, got {prompt!r}", program_id=_pid())


def _sampling_params(sampling: dict[str, Any], program_id: str) -> SamplingParams:
    try:
        return SamplingParams(**sampling)
    except (TypeError, ValueError) as e:
        raise InvalidCallError(f"bad sampling arguments {sampling!r}: {e}", program_id=program_id) from None


def _queue_wait(m: Any) -> float:
    """Time from arrival to first scheduling; 0 when the call never got that far."""
    if m is None or m.first_scheduled_time is None:
        return 0.0
    return max(0.0, m.first_scheduled_time - m.arrival_time)


# --- module-level API: the current runtime --------------------------------------------------
async def chat(messages: Sequence[dict[str, Any]], **sampling: Any) -> str:
    """Chat completion for the current program: the assistant's reply to `messages`.
    `sampling`: `engine.SamplingParams` fields (max_tokens, temperature, stop, seed, ...)."""
    rt = current_runtime()
    assert rt is not None
    return await rt.chat(messages, **sampling)


async def generate(prompt: str | list[int], **sampling: Any) -> str:
    """Plain completion of `prompt` (text or token ids) for the current program."""
    rt = current_runtime()
    assert rt is not None
    return await rt.generate(prompt, **sampling)


async def chat_stream(messages: Sequence[dict[str, Any]], **sampling: Any) -> AsyncIterator[str]:
    """Like `chat`, yielding text deltas as they are generated."""
    rt = current_runtime()
    assert rt is not None
    async with contextlib.aclosing(rt.chat_stream(messages, **sampling)) as gen:
        async for text in gen:
            yield text


async def generate_stream(prompt: str | list[int], **sampling: Any) -> AsyncIterator[str]:
    """Like `generate`, yielding text deltas as they are generated."""
    rt = current_runtime()
    assert rt is not None
    async with contextlib.aclosing(rt.generate_stream(prompt, **sampling)) as gen:
        async for text in gen:
            yield text


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

