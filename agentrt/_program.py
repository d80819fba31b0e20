"""Program identity: `@program`, threads, `gather`.

Every invocation of a `@program` function is a program: it gets an id, a name, its caller's
program as parent, a record in the current runtime's process table, and ends (finished, failed or
cancelled) when the function returns or raises, releasing what it holds.

Identity travels in context variables, so `agentrt.chat` inside the function (or anything it
awaits) knows whose call it is. Threads are tasks: the task that entered the program is thread 0;
any other task that makes a call for it (an anyio task-group child, a `gather` branch, an
`asyncio.gather` / `create_task` child) gets the next thread id the first time it calls.
A program's `num_threads` counts the threads that made calls, as a server counts the thread ids its
calls name (agentrt._programs): a `gather` of 3 branches is 3 threads, 4 when the main one called too.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import itertools
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar, overload

import anyio

from agentrt._context import Host, current_runtime
from agentrt._errors import UsageError
from agentrt._process_table import ProgramInfo
from agentrt.engine.sampling_params import MAX_PRIORITY

P = ParamSpec("P")
T = TypeVar("T")

_session = uuid.uuid4().hex[:6]  # keeps ids unique across processes sharing a server or a database
_program_ids = itertools.count(1)


@dataclass(slots=True, eq=False)
class ProgramHandle:
    """What the context variable holds for a running program."""

    info: ProgramInfo
    runtime: Host | None  # the runtime it registered with (None: ran outside any runtime)
    _threads: itertools.count = field(default_factory=functools.partial(itertools.count, 1))

    @property
    def program_id(self) -> str:
        return self.info.program_id

    def new_thread_id(self) -> str:
        return f"{self.info.program_id}.t{next(self._threads)}"


# (program, thread id, id of the task the thread id belongs to)
_current: contextvars.ContextVar[tuple[ProgramHandle, str, int] | None] = contextvars.ContextVar(
    "agentrt_program", default=None
)


def new_program_id() -> str:
    return f"prog-{_session}-{next(_program_ids)}"


def current() -> tuple[ProgramHandle, str] | None:
    """The running program and this task's thread id in it, or None outside any program."""
    cur = _current.get()
    if cur is None:
        return None
    handle, thread_id, task_id = cur
    here = anyio.get_current_task().id
    if here != task_id:  # first call from a child task: it is a new thread of the same program
        thread_id = handle.new_thread_id()
        _current.set((handle, thread_id, here))  # the child's own context copy; the parent is untouched
    return handle, thread_id


def current_program_id() -> str | None:
    """Id of the program this code runs in, or None."""
    cur = _current.get()
    return None if cur is None else cur[0].program_id


def check_priority(priority: Any, where: str) -> int:
    """A program's scheduling class: an int in SamplingParams.priority's range; UsageError naming `where`."""
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > MAX_PRIORITY:
        raise UsageError(f"{where} must be an int in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")
    return priority


def enter_program(
    name: str, make_current: bool = True, kv_reserve_tokens: int | None = None, priority: int | None = None
) -> tuple[ProgramHandle, contextvars.Token | None]:
    """Register a new program (child of the current one, if any) and make it current. `priority`: its
    calls' scheduling class; None = its parent's (0 without one)."""
    parent = _current.get()
    runtime = current_runtime(required=False)
    if priority is None:
        priority = parent[0].info.priority if parent is not None else 0
    info = ProgramInfo(
        program_id=new_program_id(),
        name=name,
        parent_id=parent[0].program_id if parent is not None else None,
        start_time=time.monotonic(),
        kv_reserve_tokens=kv_reserve_tokens,
        priority=priority,
    )
    handle = ProgramHandle(info, runtime)
    if runtime is not None:
        runtime.program_started(info)
    if not make_current:
        return handle, None
    return handle, _current.set((handle, f"{info.program_id}.t0", anyio.get_current_task().id))


def exit_program(handle: ProgramHandle, token: contextvars.Token | None, exc: BaseException | None) -> None:
    if token is not None:
        _current.reset(token)
    if exc is None:
        state, error = "finished", None
    elif isinstance(exc, anyio.get_cancelled_exc_class()):
        state, error = "cancelled", None
    else:
        state, error = "failed", repr(exc)
    if handle.runtime is not None:
        handle.runtime.program_exited(handle, state, error)
    else:
        handle.info.state, handle.info.end_time, handle.info.error = state, time.monotonic(), error


async def _settled(handle: ProgramHandle) -> None:
    """Until the ended program's record is final (through `agentrt.connect`, once the server's is in), so the
    caller of a program reads the same record in the process table in-process and through a server."""
    if handle.runtime is not None:
        await handle.runtime.program_settled(handle)


@contextlib.contextmanager
def calling_program(kind: str) -> Iterator[tuple[ProgramHandle, str]]:
    """The program and thread a call belongs to: the current ones, or outside any program a one-call program
    named `kind` (not made current, so nothing leaks to a consumer between an async generator's yields),
    ended with the block: finished, or cancelled / failed by what escapes it."""
    cur = current()
    if cur is not None:
        yield cur
        return
    handle, _ = enter_program(kind, make_current=False)
    exc: BaseException | None = None
    try:
        yield handle, f"{handle.program_id}.t0"
    except BaseException as e:
        exc = e
        raise
    finally:
        exit_program(handle, None, exc)


@overload
def program(fn: Callable[P, Awaitable[T]], /) -> Callable[P, Coroutine[Any, Any, T]]: ...
@overload
def program(
    *, name: str | None = None, kv_reserve_tokens: int | None = None, priority: int | None = None
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Coroutine[Any, Any, T]]]: ...


def program(
    fn: Callable[P, Awaitable[T]] | None = None, /, *, name: str | None = None, kv_reserve_tokens: int | None = None,
    priority: int | None = None,
) -> Any:
    """Make an async function a program: `@agentrt.program` or `@agentrt.program(name="react")`.

    `kv_reserve_tokens`: KV blocks for this many tokens are set aside for each run of it, used by its
    calls first and by no one else's (capped with all reservations; agentrt._retention).

    `priority`: the scheduling class of its calls (smaller first, before the policy's order; a call's
    own non-zero `priority` wins); None = the calling program's (0 at the top).

    Each call runs as a new program (a child of the calling program, if any). Its LLM calls carry
    its id; when it returns, raises or is cancelled it ends, and the runtime aborts whatever calls
    of it are still in flight and releases what the engine holds for it.
    """

    if kv_reserve_tokens is not None and (
        isinstance(kv_reserve_tokens, bool) or not isinstance(kv_reserve_tokens, int) or kv_reserve_tokens < 0
    ):
        raise UsageError(f"@agentrt.program(kv_reserve_tokens=...) must be an int >= 0, got {kv_reserve_tokens!r}")
    if priority is not None:
        check_priority(priority, "@agentrt.program(priority=...)")

    def decorate(f: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
        if not inspect.iscoroutinefunction(f):
            raise UsageError(f"@agentrt.program needs an async function (async def), got {f!r}")
        prog_name = name if name is not None else getattr(f, "__name__", repr(f))

        @functools.wraps(f)
        async def run_program(*args: P.args, **kwargs: P.kwargs) -> T:
            handle, token = enter_program(prog_name, kv_reserve_tokens=kv_reserve_tokens, priority=priority)
            try:
                result = await f(*args, **kwargs)
            except BaseException as exc:
                exit_program(handle, token, exc)
                if not isinstance(exc, anyio.get_cancelled_exc_class()):
                    await _settled(handle)
                raise
            exit_program(handle, token, None)
            await _settled(handle)
            return result

        return run_program

    if fn is not None:
        return decorate(fn)
    return decorate


async def gather(*aws: Awaitable[T]) -> list[T]:
    """Await all concurrently, each in its own task (its own thread of the current program); results
    in order. If one raises, the others are cancelled and its exception propagates (a group of
    several when more than one failed)."""
    results: list[Any] = [None] * len(aws)

    async def branch(i: int, aw: Awaitable[T]) -> None:
        results[i] = await aw

    try:
        async with anyio.create_task_group() as tg:
            for i, aw in enumerate(aws):
                tg.start_soon(branch, i, aw)
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    return results
