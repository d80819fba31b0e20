"""The process table: one record per program, as the runtime sees it.

Times are `time.monotonic()` seconds, like the engine's request timestamps. Service numbers are
the engine's executor time attributed to each call (a step's wall time split across its requests
by their share of the step's tokens), so they add up to model time, not latency.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from agentrt._errors import ProgramNotFoundError

ProgramStatus = Literal["running", "finished", "failed", "cancelled"]

# Histories keep the latest values only (a long-running program or server would grow them forever);
# enough for the TTL and sizing estimates that read them. Bounded deques: iterate, index, len() as
# lists; `list(...)` them to slice or to serialize.
PROGRAM_HISTORY = 256  # gaps and tool durations kept per program (per tool)
TOOL_HISTORY = 1000  # durations kept per tool across all programs


def _history(maxlen: int) -> collections.deque[float]:
    return collections.deque(maxlen=maxlen)


@dataclass(slots=True)
class ProgramInfo:
    """One program's record. Live while it runs; kept (up to a cap) after it ends."""

    program_id: str
    name: str
    parent_id: str | None  # the program that called this one, if any
    start_time: float
    state: ProgramStatus = "running"
    end_time: float | None = None
    error: str | None = None  # repr of the exception that ended it, when failed
    calls_waiting: int = 0  # submitted, no token yet
    calls_running: int = 0  # producing tokens
    calls_done: int = 0  # finished (any reason)
    num_calls: int = 0  # calls given an id (`ProcessTable.new_call_id`), across the records of its id this run
    service_s: float = 0.0  # attained service: Σ executor time of its completed calls
    critical_path_s: float = 0.0  # longest chain of executor time (parallel threads overlap)
    wait_s: float = 0.0  # Σ over completed calls of queueing time, arrival -> first scheduled
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_prefix_hit_tokens: int = 0  # prompt tokens of its completed calls served from the prefix cache
    last_call_arrival: float | None = None
    last_call_completion: float | None = None
    gaps_s: collections.deque[float] = field(default_factory=functools.partial(collections.deque, maxlen=PROGRAM_HISTORY))  # idle time
    # between a call's end and the next call, the latest PROGRAM_HISTORY
    tool_durations: dict[str, collections.deque[float]] = field(default_factory=dict)  # seconds per call, by
    # tool name, the latest PROGRAM_HISTORY of each
    num_threads: int = 1  # threads that made calls (parallel branches, and the main one if it called); 1 before any
    children: list[str] = field(default_factory=list)  # ids of programs it called
    owner: str | None = None  # the client (API-key fingerprint) that started it, for programs started by id
    kv_reserve_tokens: int | None = None  # KV declared for it (`@agentrt.program(kv_reserve_tokens=...)`)
    priority: int = 0  # the scheduling class of its calls (SamplingParams.priority) unless a call names its own
    last_tool: str | None = None  # the tool it ran since its latest call (Runtime.tool_started), for its next call
    live_calls: dict[str, CallRecord] = field(default_factory=dict)  # its calls in flight, by request id
    traceparent: str | None = None  # W3C trace context its first call came with: its trace joins the caller's
    kv: Any = None  # engine.kv_cache_manager.OwnerKV at its latest call's end: blocks held, pinned, reserved,
    # TTL hits / misses / expiries, recomputed prefill tokens; Runtime.program_kv for now. Once it ended, its
    # counts with nothing held (no blocks, pins, reservation or TTL: the end released them)

    @property
    def calls_active(self) -> int:
        return self.calls_waiting + self.calls_running

    @property
    def latency_s(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.start_time


@dataclass(slots=True)
class CallRecord:
    """Runtime-side bookkeeping of one in-flight call."""

    request_id: str
    thread_id: str
    arrival: float
    start_critical_path_s: float  # the program's critical path when the call was made
    running: bool = False
    first_token: float | None = None  # time.monotonic() of its first token
    tool: str | None = None  # the tool the program ran between its previous call and this one, if told
    pin_ttl_s: float | None = None  # the TTL its program's KV is pinned for when it ends (None: no retention)
    priority: int = 0  # its scheduling class (SamplingParams.priority)


class ProcessTable:
    """Programs by id. `table[pid]` raises `ProgramNotFoundError`; iteration yields every record."""

    def __init__(self, max_finished: int = 10_000) -> None:
        self._programs: dict[str, ProgramInfo] = {}
        self._finished: collections.deque[str] = collections.deque()
        self.max_finished = max_finished  # ended programs kept for inspection, oldest dropped first
        self.num_waiting = 0  # calls of all programs submitted that have produced no token yet
        self.num_output_tokens = 0  # tokens every call has streamed so far, cumulative (the live page's tokens/s)
        self.tool_durations: dict[str, collections.deque[float]] = {}  # all programs, by tool name, the
        # latest TOOL_HISTORY of each

    # --- queries ------------------------------------------------------------------------------
    def __getitem__(self, program_id: str) -> ProgramInfo:
        try:
            return self._programs[program_id]
        except KeyError:
            raise ProgramNotFoundError("no such program in the process table", program_id=program_id) from None

    def get(self, program_id: str) -> ProgramInfo | None:
        return self._programs.get(program_id)

    def __contains__(self, program_id: object) -> bool:
        return program_id in self._programs

    def __iter__(self) -> Iterator[ProgramInfo]:
        return iter(list(self._programs.values()))

    def __len__(self) -> int:
        return len(self._programs)

    def running(self) -> list[ProgramInfo]:
        return [p for p in self._programs.values() if p.state == "running"]

    # --- updates (the runtime's) -----------------------------------------------------------
    def start(self, info: ProgramInfo) -> None:
        old = self._programs.get(info.program_id)
        if old is not None:  # an ended program's id, started again: the new record replaces it
            self._finished.remove(info.program_id)
            info.num_calls = max(info.num_calls, old.num_calls)  # its call ids go on from the old record's
        self._programs[info.program_id] = info
        if info.parent_id is not None and (parent := self._programs.get(info.parent_id)) is not None:
            parent.children.append(info.program_id)

    def end(self, info: ProgramInfo, state: ProgramStatus, error: str | None = None) -> None:
        info.state, info.end_time, info.error = state, time.monotonic(), error
        self._finished.append(info.program_id)
        while len(self._finished) > self.max_finished:
            self._programs.pop(self._finished.popleft(), None)

    def new_call_id(self, info: ProgramInfo) -> str:
        """The id of the program's next call: `{program id}-c{n}`, n counting its calls from 1 (an id started
        again after its program ended goes on counting, so call ids stay unique in this process table)."""
        info.num_calls += 1
        return f"{info.program_id}-c{info.num_calls}"

    def call_started(self, info: ProgramInfo, request_id: str, thread_id: str, num_prompt_tokens: int) -> CallRecord:
        now = time.monotonic()
        if info.calls_active == 0 and info.last_call_completion is not None:
            info.gaps_s.append(now - info.last_call_completion)
        info.calls_waiting += 1
        self.num_waiting += 1
        info.last_call_arrival = now
        info.num_prompt_tokens += num_prompt_tokens
        call = info.live_calls[request_id] = CallRecord(request_id, thread_id, now, info.critical_path_s,
                                                        tool=info.last_tool)
        info.last_tool = None
        return call

    def call_running(self, info: ProgramInfo, call: CallRecord) -> None:
        if not call.running:
            call.running = True
            call.first_token = time.monotonic()
            info.calls_waiting -= 1
            self.num_waiting -= 1
            info.calls_running += 1

    def call_done(
        self,
        info: ProgramInfo,
        call: CallRecord,
        *,
        service_s: float,
        wait_s: float,
        num_output_tokens: int,
        num_prefix_hit_tokens: int = 0,
    ) -> None:
        if call.running:
            info.calls_running -= 1
        else:
            info.calls_waiting -= 1
            self.num_waiting -= 1
        info.calls_done += 1
        info.live_calls.pop(call.request_id, None)
        info.service_s += service_s
        info.critical_path_s = max(info.critical_path_s, call.start_critical_path_s + service_s)
        info.wait_s += wait_s
        info.num_output_tokens += num_output_tokens
        info.num_prefix_hit_tokens += num_prefix_hit_tokens
        info.last_call_completion = time.monotonic()

    def record_tool(self, info: ProgramInfo | None, tool: str, duration_s: float) -> None:
        _record(self.tool_durations, tool, duration_s, TOOL_HISTORY)
        if info is not None:
            _record(info.tool_durations, tool, duration_s, PROGRAM_HISTORY)


def _record(histories: dict[str, collections.deque[float]], key: str, value: float, maxlen: int) -> None:
    history = histories.get(key)
    if history is None:
        history = histories[key] = _history(maxlen)
    history.append(value)
