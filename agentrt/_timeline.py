"""Program timelines: when each call of a program waited, ran its prefill and decoded, what came between
(tool gaps), where it was preempted and how long its KV stayed pinned after it, drawn from call records.

    tl = build_timeline(program_id, name, state, started_at, ended_at, calls, now=time.time())

`calls` are records with the fields of `CallTimes` (the server's stored `CallRecord` has them too, so a
finished program's timeline comes from the SQL records after a restart, and a running one's from the
records of its ended calls plus `live_call_times` of those in flight). The timeline adds nothing the
records do not say: every time in it is a record's time, or a sum of them (the totals).

Times are unix epoch seconds; durations seconds. A call's phases:

    arrival ── queued ── scheduled ── prefill ── first token ── decode ── end
                                         (a preemption sends it back to waiting, then prefill again)
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentrt._process_table import CallRecord as LiveCall
from agentrt._process_table import ProgramInfo
from agentrt._programs import RuntimeObserver

if TYPE_CHECKING:
    from agentrt._call import CallSummary
    from agentrt.engine import AsyncEngine
    from agentrt.engine.client import RequestInfo


@dataclass(slots=True)
class CallTimes:
    """One call's times and counts, as its record keeps them (field names as the server's CallRecord)."""

    request_id: str
    thread_id: str | None
    arrival_at: float  # epoch s
    queued_s: float | None  # arrival -> first scheduled; None: never scheduled (yet)
    first_token_s: float | None  # arrival -> first token; None: none (yet)
    finished_at: float | None  # epoch s; None: in flight
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens from the prefix cache
    num_tier_loaded_tokens: int = 0  # of those, loaded from a KV tier below the pool
    preemptions: list[list[float | None]] | None = None  # [preempted, scheduled again or None], s from arrival
    pin_ttl_s: float | None = None  # TTL of its program's KV pin when it ended
    tool: str | None = None  # the tool its program ran before it
    replica: str | None = None  # the replica that served it (serve --replicas)
    finish_reason: str | None = None
    priority: int = 0  # scheduling class
    service_s: float = 0.0  # executor time attributed to it


def call_times(s: CallSummary, replica: str | None = None) -> CallTimes:
    """An ended call's record, from what its end reported."""
    return CallTimes(
        request_id=s.request_id, thread_id=s.thread_id, arrival_at=s.arrival_at,
        queued_s=s.wait_s if s.scheduled else None, first_token_s=s.ttft_s, finished_at=s.arrival_at + s.e2e_s,
        num_prompt_tokens=s.num_prompt_tokens, num_output_tokens=s.num_output_tokens,
        num_cached_tokens=s.num_cached_tokens, num_tier_loaded_tokens=s.num_tier_loaded_tokens,
        preemptions=[[a, b] for a, b in s.preemptions] or None, pin_ttl_s=s.pin_ttl_s, tool=s.tool, replica=replica,
        finish_reason=s.finish_reason, priority=s.priority, service_s=s.service_s,
    )


def live_call_times(call: LiveCall, info: RequestInfo | None, to_wall: float) -> CallTimes:
    """A call in flight: its process-table record and (None once it left) the engine's view of its request.
    `to_wall`: time.time() - time.monotonic()."""
    queued = None
    if info is not None and info.first_scheduled_time is not None:
        queued = max(0.0, info.first_scheduled_time - call.arrival)
    elif call.first_token is not None:
        queued = call.first_token - call.arrival
    return CallTimes(
        request_id=call.request_id, thread_id=call.thread_id, arrival_at=call.arrival + to_wall, queued_s=queued,
        first_token_s=None if call.first_token is None else call.first_token - call.arrival, finished_at=None,
        tool=call.tool, priority=call.priority,
    )


def in_flight(info: ProgramInfo, engine: AsyncEngine | None, to_wall: float) -> list[CallTimes]:
    """The program's calls in flight now, as records."""
    return [live_call_times(c, engine.request_info(c.request_id) if engine is not None else None, to_wall)
            for c in list(info.live_calls.values())]


@dataclass(slots=True)
class Preemption:
    at: float  # epoch s
    resumed_at: float | None  # scheduled again; None: not (yet)


@dataclass(slots=True)
class CallBar:
    """One call on its thread's row: [arrival, scheduled) queued, [scheduled, first_token) prefill,
    [first_token, end) decode. Missing boundaries are None (a call still queued has no scheduled_at)."""

    request_id: str
    thread_id: str
    state: str  # "queued" / "prefill" / "decode" while in flight; else its finish reason ("stop", "length", ...)
    arrival_at: float
    scheduled_at: float | None
    first_token_at: float | None
    end_at: float  # its end, or now for a call in flight
    running: bool  # in flight
    num_prompt_tokens: int
    num_cached_tokens: int
    num_tier_loaded_tokens: int
    num_output_tokens: int
    preemptions: list[Preemption]
    pin_until: float | None  # its program's KV pinned after it until then (its TTL); None: no pin
    tool: str | None  # the tool run before it (the gap before it on its thread)
    replica: str | None
    priority: int
    service_s: float


@dataclass(slots=True)
class Gap:
    """Between two calls of one thread: the program ran a tool (or its own code)."""

    thread_id: str
    start_at: float
    end_at: float
    tool: str | None


@dataclass(slots=True)
class ThreadRow:
    thread_id: str
    calls: list[CallBar] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)


@dataclass(slots=True)
class Totals:
    """Sums over the program's calls (seconds of each phase over all threads, so threads overlap)."""

    calls: int = 0
    calls_in_flight: int = 0
    wall_s: float = 0.0  # the program's start -> its end (or now)
    queued_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    tool_s: float = 0.0  # Σ gaps
    preempted_s: float = 0.0  # Σ time from a preemption to its rescheduling
    service_s: float = 0.0  # Σ executor time
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_tier_loaded_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    replicas: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Timeline:
    program_id: str
    name: str
    state: str
    started_at: float  # epoch s
    ended_at: float | None
    now: float  # when it was drawn (the end of calls in flight)
    threads: list[ThreadRow]
    totals: Totals

    @property
    def calls(self) -> list[CallBar]:
        """Every call, by arrival."""
        return sorted((c for t in self.threads for c in t.calls), key=lambda c: (c.arrival_at, c.request_id))

    def to_dict(self) -> dict[str, Any]:
        import msgspec

        return msgspec.to_builtins(self)


def _bar(c: Any, now: float) -> CallBar:
    a = c.arrival_at
    end = c.finished_at if c.finished_at is not None else now
    first = None if c.first_token_s is None else min(end, a + c.first_token_s)
    scheduled = None
    if c.queued_s is not None:
        scheduled = min(end if first is None else first, a + c.queued_s)
    running = c.finished_at is None
    if running:
        state = "queued" if scheduled is None else "prefill" if first is None else "decode"
    else:
        state = c.finish_reason or "ended"
    preemptions = [Preemption(a + at, None if back is None else a + back) for at, back in (c.preemptions or ())]
    ttl = c.pin_ttl_s
    return CallBar(
        request_id=c.request_id, thread_id=c.thread_id or "", state=state, arrival_at=a, scheduled_at=scheduled,
        first_token_at=first, end_at=end, running=running, num_prompt_tokens=c.num_prompt_tokens or 0,
        num_cached_tokens=c.num_cached_tokens or 0, num_tier_loaded_tokens=c.num_tier_loaded_tokens or 0,
        num_output_tokens=c.num_output_tokens or 0, preemptions=preemptions,
        pin_until=end + ttl if ttl and not running else None, tool=c.tool, replica=c.replica,
        priority=c.priority or 0, service_s=c.service_s or 0.0,
    )


def build_timeline(program_id: str, name: str, state: str, started_at: float, ended_at: float | None,
                   calls: Iterable[Any], now: float | None = None) -> Timeline:
    """The timeline of one program from its call records (`CallTimes`-like objects): a row per thread in
    order of its first call, each thread's calls by arrival with the gaps between them, and the totals."""
    now = time.time() if now is None else now
    rows: dict[str, ThreadRow] = {}
    for bar in sorted((_bar(c, now) for c in calls), key=lambda b: (b.arrival_at, b.request_id)):
        rows.setdefault(bar.thread_id, ThreadRow(bar.thread_id)).calls.append(bar)
    t = Totals(wall_s=max(0.0, (ended_at if ended_at is not None else now) - started_at))
    replicas: dict[str, None] = {}
    for row in rows.values():
        for prev, nxt in zip(row.calls, row.calls[1:]):
            if not prev.running and nxt.arrival_at > prev.end_at:
                row.gaps.append(Gap(row.thread_id, prev.end_at, nxt.arrival_at, nxt.tool))
        t.tool_s += sum(g.end_at - g.start_at for g in row.gaps)
        for b in row.calls:
            t.calls += 1
            t.calls_in_flight += b.running
            prefill_from = b.scheduled_at if b.scheduled_at is not None else b.end_at
            t.queued_s += prefill_from - b.arrival_at
            if b.scheduled_at is not None:
                t.prefill_s += (b.first_token_at if b.first_token_at is not None else b.end_at) - b.scheduled_at
            if b.first_token_at is not None:
                t.decode_s += b.end_at - b.first_token_at
            t.preempted_s += sum((p.resumed_at if p.resumed_at is not None else b.end_at) - p.at for p in b.preemptions)
            t.num_preemptions += len(b.preemptions)
            t.service_s += b.service_s
            t.num_prompt_tokens += b.num_prompt_tokens
            t.num_cached_tokens += b.num_cached_tokens
            t.num_tier_loaded_tokens += b.num_tier_loaded_tokens
            t.num_output_tokens += b.num_output_tokens
            if b.replica:
                replicas[b.replica] = None
    t.replicas = list(replicas)
    return Timeline(program_id, name, state, started_at, ended_at, now, list(rows.values()), t)


class TimelineKeeper(RuntimeObserver):
    """`Runtime(trace=True)`: every call's record, per program, for `Runtime.timeline` (a runtime observer).
    Bounded: the latest `max_programs` programs, `max_calls` calls each."""

    def __init__(self, max_programs: int = 10_000, max_calls: int = 10_000) -> None:
        self.calls: collections.OrderedDict[str, collections.deque[CallTimes]] = collections.OrderedDict()
        self.max_programs = max_programs
        self.max_calls = max_calls

    def call_ended(self, s: CallSummary) -> None:
        calls = self.calls.get(s.program_id)
        if calls is None:
            calls = self.calls[s.program_id] = collections.deque(maxlen=self.max_calls)
            while len(self.calls) > self.max_programs:
                self.calls.popitem(last=False)
        calls.append(call_times(s))
