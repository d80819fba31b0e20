"""The program manager: the runtime's programs from start to end, and what the engine holds for them.

    manager.start_program("p1", owner=key)     # a program known by id (the server's)
    handle = manager.handle_for("p1", key, name="agent")
    record = manager.call_submitted(handle, rid, thread_id, num_prompt_tokens)
    ...
    manager.end_program("p1")                  # aborts its calls, releases its KV, tells the observers

`Runtime` owns one and makes the calls; a program's calls (`agentrt._call.Call`) report back through the
runtime. Programs made by `@agentrt.program` functions register here too (`program_started`,
`program_exited`). The process table is the record; observers (the server's store and metrics) hear of
every start, end and call end.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import anyio

from agentrt._errors import ProgramExistsError, ProgramNotFoundError
from agentrt._process_table import CallRecord, ProcessTable, ProgramInfo, ProgramStatus
from agentrt._program import ProgramHandle, check_priority, new_program_id
from agentrt._retention import RetentionConfig, RetentionPolicy
from agentrt.engine import AsyncEngine, SchedulingPolicy
from agentrt.engine.ownership import OwnerKV
from agentrt.engine.program_ops import EndProgram

if TYPE_CHECKING:
    from agentrt._call import Call, CallSummary
    from agentrt._chat_prompt import ChatPrompts

ANY_OWNER: Any = object()  # `owner=` default of the program look-ups: any client's program


class RuntimeObserver:
    """Hears of program starts and ends and of every call's end (the server's store and metrics).
    Called on the event loop: an observer must not block."""

    def program_started(self, info: ProgramInfo) -> None: ...

    def program_ended(self, info: ProgramInfo) -> None: ...

    def call_ended(self, summary: CallSummary) -> None: ...


def ended_kv(kv: OwnerKV) -> OwnerKV:
    """An ended program's KV record: what it held (blocks, pins, reservation, TTL) is released with its end, so
    0; its counts (TTL hits, misses, expiries, recomputed and tier-loaded tokens) stay."""
    return dataclasses.replace(kv, held=0, pinned=0, reserved=0, reserved_used=0, ttl_s=0.0)


class ProgramManager:
    """Programs and their calls in flight; see the module docstring. `engine`: the running engine (None when
    stopped; the runtime sets it); `host`: the runtime, each handle's; `chat`: the runtime's chat prompts,
    which remember a chat call's reply and forget an ended program."""

    def __init__(self, policy: SchedulingPolicy, host: Any, chat: ChatPrompts) -> None:
        self.table = ProcessTable()
        self.observers: list[RuntimeObserver] = []
        self.engine: AsyncEngine | None = None
        self.retention: RetentionPolicy | None = None  # while the engine runs
        self.inflight: dict[str, set[str]] = {}  # program id -> request ids in the engine
        self._policy = policy
        self._host = host
        self._chat = chat
        self._keyed: dict[str, ProgramHandle] = {}  # running programs started by id (`start_program`, the server)
        self._thread_ids: dict[str, set[str]] = {}  # program id -> thread ids its calls named (num_threads)

    @property
    def num_waiting(self) -> int:
        """Calls submitted that have produced no token yet."""
        return self.table.num_waiting

    def engine_started(self, engine: AsyncEngine, retention: RetentionConfig) -> None:
        """The runtime's engine runs: program operations go straight to it."""
        self.engine = engine
        info = engine.info
        self.retention = RetentionPolicy(retention, engine.program_op, info.num_blocks * info.block_size,
                                         reload_s_per_token=info.kv_reload_s_per_token)

    def engine_stopped(self) -> None:
        self.engine = self.retention = None

    # --- lifetime -----------------------------------------------------------------------------
    def program_started(self, info: ProgramInfo, one_call: bool = False) -> None:
        """`one_call`: a program of one call, ended with it: nothing to pin or reserve for it, so the engine
        hears of it only at its end (EndProgram), not at its start."""
        self.table.start(info)
        if self.retention is not None and not one_call:
            self.retention.program_started(info.program_id, info.kv_reserve_tokens)
        for o in self.observers:
            o.program_started(info)

    def program_exited(self, handle: ProgramHandle, state: ProgramStatus, error: str | None,
                       one_call: bool = False) -> None:
        """Release everything the program holds: abort its calls still in flight, tell the policy. `one_call`:
        the program of one call (`program_started`), which remembered no chat and holds no pins or reservation."""
        pid = handle.info.program_id
        if self._keyed.get(pid) is handle:
            del self._keyed[pid]
        self._thread_ids.pop(pid, None)
        if not one_call:
            self._chat.forget(pid)
        engine = self.engine
        for rid in self.inflight.pop(pid, ()):
            if engine is not None:
                engine.abort(rid)
        if self.retention is not None and engine is not None:
            handle.info.kv = engine.program_kv(pid)
            if one_call:
                engine.program_op(EndProgram(pid))  # the engine tells the policy
            else:
                self.retention.program_ended(pid)  # the engine releases its KV and tells the policy
        else:
            self._policy.end_program(pid)
        if handle.info.kv is not None:
            handle.info.kv = ended_kv(handle.info.kv)
        self.table.end(handle.info, state, error)
        for o in self.observers:
            o.program_ended(handle.info)

    def end_all(self, state: ProgramStatus, error: str | None) -> None:
        """End every program started by id (the runtime stops)."""
        for handle in list(self._keyed.values()):
            self.program_exited(handle, state, error)

    def abort_program(self, program_id: str, engine: AsyncEngine) -> int:
        rids = self.inflight.get(program_id, set())
        for rid in list(rids):
            engine.abort(rid)
        return len(rids)

    def start_program(self, program_id: str | None = None, *, name: str = "program", owner: str | None = None,
                      priority: int = 0, one_call: bool = False) -> ProgramHandle:
        """Start a program known by id (None: a new id) and return its handle."""
        check_priority(priority, "priority")
        if program_id is None:
            program_id, old = new_program_id(), None  # a new id is nobody's
        else:
            old = self.table.get(program_id)
        if old is not None and old.state == "running":
            raise ProgramExistsError("a program with this id is already running", program_id=program_id)
        if old is not None and old.owner != owner:  # an ended program's id stays its owner's while the table keeps it
            raise ProgramExistsError("this program id belongs to another client", program_id=program_id)
        info = ProgramInfo(program_id=program_id, name=name, parent_id=None, start_time=time.monotonic(), owner=owner,
                           priority=priority)
        self._keyed[program_id] = handle = ProgramHandle(info, self._host)
        self.program_started(info, one_call)
        return handle

    def end_program(self, program_id: str, *, owner: Any = ANY_OWNER, state: ProgramStatus = "finished") -> ProgramInfo:
        handle = self.keyed_handle(program_id, owner)
        self.program_exited(handle, state, None)
        return handle.info

    def keyed_handle(self, program_id: str, owner: Any = ANY_OWNER) -> ProgramHandle:
        """The handle of a running program started by id (ProgramNotFoundError otherwise)."""
        handle = self._keyed.get(program_id)
        if handle is None or (owner is not ANY_OWNER and handle.info.owner != owner):
            raise ProgramNotFoundError("no such running program", program_id=program_id)
        return handle

    def handle_for(self, program_id: str, owner: str | None, name: str) -> ProgramHandle:
        """The running program `program_id` of `owner`, started (named `name`) if unknown."""
        handle = self._keyed.get(program_id)
        if handle is None or handle.info.owner != owner:
            if handle is not None or (program_id in self.table and self.table[program_id].state == "running"):
                raise ProgramNotFoundError("no such program", program_id=program_id)  # another owner's
            handle = self.start_program(program_id, name=name, owner=owner)
        return handle

    async def reap_idle(self, timeout_s: float) -> None:
        """End the programs started by id that made no call for `timeout_s` (runs until cancelled)."""
        while True:
            await anyio.sleep(min(1.0, timeout_s / 4))
            now = time.monotonic()
            for handle in list(self._keyed.values()):
                info = handle.info
                last = max(info.start_time, info.last_call_completion or 0.0)
                if info.calls_active == 0 and now - last >= timeout_s:
                    self.program_exited(handle, "finished", None)

    # --- look-ups -----------------------------------------------------------------------------
    def program(self, program_id: str, owner: Any = ANY_OWNER) -> ProgramInfo:
        info = self.table.get(program_id)
        if info is None or (owner is not ANY_OWNER and info.owner != owner):
            raise ProgramNotFoundError("no such program", program_id=program_id)
        return info

    def program_queue_level(self, program_id: str) -> int | None:
        engine = self.engine
        if engine is None:
            return None
        levels = [r.queue_level for r in self._requests(engine, program_id) if r.queue_level is not None]
        return min(levels, default=None)

    def program_kv_blocks(self, program_id: str) -> int:
        engine = self.engine
        if engine is None:
            return 0
        return len({b for r in self._requests(engine, program_id) for b in r.block_ids})

    def program_kv(self, program_id: str) -> OwnerKV | None:
        engine = self.engine
        return None if engine is None else engine.program_kv(program_id)

    def _requests(self, engine: AsyncEngine, program_id: str) -> list[Any]:
        infos = (engine.request_info(rid) for rid in list(self.inflight.get(program_id, ())))
        return [i for i in infos if i is not None]

    # --- calls --------------------------------------------------------------------------------
    def call_submitted(self, handle: ProgramHandle, request_id: str, thread_id: str,
                       num_prompt_tokens: int) -> CallRecord:
        """A call of the program is in the engine now: its record in the process table."""
        pid = handle.info.program_id
        self.inflight.setdefault(pid, set()).add(request_id)
        threads = self._thread_ids.setdefault(pid, set())  # the threads that made calls, the main one if it did
        threads.add(thread_id)  # (the same count in-process and on a server, which sees only the calls' thread ids)
        handle.info.num_threads = max(handle.info.num_threads, len(threads))
        return self.table.call_started(handle.info, request_id, thread_id, num_prompt_tokens)

    def abort_call(self, request_id: str) -> None:
        """Abort a call's engine request (its stream ends with finish_reason "abort")."""
        if self.engine is not None:
            self.engine.abort(request_id)

    def call_ended(self, call: Call, summary: CallSummary, num_prefix_hit_tokens: int) -> None:
        """A call's request left the engine (`Call.close`, once): its record, the runtime's in-flight map and
        chat memory, retention and the observers; a one-call program ends with its call."""
        pid, info = call.program_id, call.info
        if call.kind == "chat" and call.one_call is None:  # the next call of its program renders it again
            self._chat.remember_reply(pid, call.output)
        inflight = self.inflight.get(pid)
        if inflight is not None:
            inflight.discard(call.request_id)
            if not inflight:
                del self.inflight[pid]
        self.table.call_done(info, call.record, service_s=summary.service_s, wait_s=summary.wait_s,
                             num_output_tokens=summary.num_output_tokens, num_prefix_hit_tokens=num_prefix_hit_tokens)
        if self.retention is not None:
            tokens = summary.num_prompt_tokens + summary.num_output_tokens
            self.retention.call_ended(pid, time.monotonic(), tokens=tokens, computed_tokens=tokens,
                                      service_s=summary.service_s, wait_s=summary.wait_s)
            if call.one_call is None and info.state == "running" and self.engine is not None:
                info.kv = self.engine.program_kv(pid)  # a one-call program's is read as it ends, below
        for o in self.observers:
            o.call_ended(summary)
        if call.one_call is not None:
            state: ProgramStatus = "finished" if summary.finish_reason in ("stop", "length") else "failed"
            self.program_exited(call.one_call, state, summary.error, one_call=True)
