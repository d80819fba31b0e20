"""Retention policy: how long to keep a program's KV across a tool call, and how much to set aside.

The engine pins and reserves (engine.kv_cache_manager); this decides how long and how much, after
Continuum (arXiv 2511.02230, §4-5; ALGORITHMS.md):

    tau* = argmax over tau in {0} U {observed durations of the tool} of
           P(duration <= tau) * (T * eta + reload) - tau

- durations: per tool, the gap from a call's end to the program's next call, attributed to the tool the
  program ran in between (`@agentrt.tool` names it in-process; over HTTP the `role: "tool"` message or
  the function name of the reply's tool call). Fewer than `min_tool_samples` for a tool: the pooled
  durations of all tools; fewer than `min_pooled_samples` overall: `default_ttl_s`.
- reload: the time to recompute the program's context, its last call's tokens times the measured
  executor seconds per token (`s_per_token`, a running mean over calls; `initial_s_per_token` before).
- T: the running mean queueing delay of calls (arrival -> first scheduled): what a call whose prefix
  is gone waits again behind others, besides its recompute.
- eta: the share of calls that were followed by another call of their program (a program's last call
  is not): how well "this program continues" predicted more turns.

An explicit TTL wins: `@agentrt.tool(ttl=...)` for that tool. A call that says it is the program's
last unpins at once. Reservations: `@agentrt.program(kv_reserve_tokens=N)` reserves N tokens' worth of
blocks at the program's start; with `auto_reserve`, every program's reservation follows its observed
context (its last call's tokens plus the growth of its last turn); the runtime keeps the sum of all
reservations under `max_reserved_fraction` of the cache, so unreserved traffic always has room.
Everything is released at the program's end (the engine's `EndProgram`).

Defaults: `default_ttl_s` = 2 s, Continuum's small default for a tool not yet seen, and above the
0.1-0.6 s median tool latency of published agent traces, so a first pin covers most first tools;
`min_tool_samples` = 20 and `min_pooled_samples` = 5 (Continuum pools below 100 samples per tool; our
real-engine runs see tens of calls per tool, so 100 would never leave the pooled estimate);
`max_ttl_s` = 60 s bounds a pin whatever the estimates say.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from agentrt.engine.program_ops import (
    EndProgram,
    Pin,
    ProgramOp,
    Release,
    Reserve,
    StartProgram,
)

TOOL_HISTORY = 1000  # durations kept per tool, and pooled


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """Runtime retention settings (agentrt.Runtime(retention=...))."""

    ttl: bool = True  # pin programs' KV across tool calls (False: the engine's plain LRU prefix cache)
    default_ttl_s: float = 2.0  # TTL before enough durations are known
    max_ttl_s: float = 60.0  # upper bound on any chosen TTL
    min_tool_samples: int = 20  # below this many durations for a tool, use all tools' durations
    min_pooled_samples: int = 5  # below this many durations overall, use default_ttl_s
    initial_s_per_token: float = 0.002  # executor seconds per token before any call is measured
    auto_reserve: bool = False  # reserve every program's observed context (not only declared ones)
    max_reserved_fraction: float = 0.25  # all reservations together, as a fraction of the cache

    def __post_init__(self) -> None:
        for name in ("default_ttl_s", "max_ttl_s", "initial_s_per_token"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"RetentionConfig.{name} must be a finite number >= 0, got {v!r}")
        for name in ("min_tool_samples", "min_pooled_samples"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"RetentionConfig.{name} must be an int >= 1, got {v!r}")
        if not 0 <= self.max_reserved_fraction < 1:
            raise ValueError(f"RetentionConfig.max_reserved_fraction must be in [0, 1), got {self.max_reserved_fraction!r}")


def choose_ttl(durations: list[float], gain_s: float) -> float:
    """tau* over sorted `durations`: argmax of P(d <= tau) * gain_s - tau over {0} U durations (the
    smallest such tau on ties; 0 unless some tau gains more than it costs). Vectorized: it runs on every
    call and tool start, over up to `TOOL_HISTORY` durations."""
    n = len(durations)
    if n == 0:
        return 0.0
    d = np.asarray(durations, dtype=np.float64)
    values = np.arange(1, n + 1) / n * gain_s - d
    values[:-1][d[1:] == d[:-1]] = -np.inf  # ties: P counts them all at the last one
    i = int(np.argmax(values))
    return float(d[i]) if values[i] > 0.0 else 0.0


@dataclass(slots=True)
class _Program:
    context_tokens: int = 0  # tokens of its last call (prompt + output)
    growth_tokens: int = 0  # how much its context grew from the call before
    last_tool: str | None = None  # the tool it ran since its last call (if named)
    tool_ttl_s: float | None = None  # that tool's explicit TTL
    last_call_end: float | None = None  # runtime clock
    reserve_tokens: int = 0  # tokens' worth currently asked for
    declared_reserve: int | None = None
    calls: int = 0


class RetentionPolicy:
    """Decides pins and reservations; sends them to the engine as program operations through `send`."""

    def __init__(self, config: RetentionConfig, send: Callable[[ProgramOp], None], cache_tokens: int,
                 reload_s_per_token: float | None = None):
        self.config = config
        # with KV tiers below the cache (engine.kv_tiers) a lost prefix is loaded back, not recomputed: the reload
        # term of the TTL's gain is the cheaper of the two (Continuum's cost model with offloading)
        self.reload_s_per_token = reload_s_per_token
        self.send = send
        self.cache_tokens = cache_tokens  # KV cache size in tokens (reservation cap)
        self.durations: dict[str, collections.deque[float]] = {}  # by tool, sorted on use
        self.pooled: collections.deque[float] = collections.deque(maxlen=TOOL_HISTORY)
        self.s_per_token = config.initial_s_per_token
        self.queue_delay_s = 0.0
        self.calls = 0
        self.continued = 0  # calls followed by another call of their program
        self._programs: dict[str, _Program] = {}
        self._reserved = 0  # tokens reserved over all programs

    # --- estimates --------------------------------------------------------------------------
    @property
    def eta(self) -> float:
        return self.continued / self.calls if self.calls else 1.0

    def ttl_for(self, tool: str | None, context_tokens: int) -> float:
        """tau* for a program of `context_tokens` about to run `tool` (None: unknown)."""
        c = self.config
        samples = self.durations.get(tool) if tool is not None else None
        if samples is None or len(samples) < c.min_tool_samples:
            samples = self.pooled
        if len(samples) < c.min_pooled_samples:
            return min(c.default_ttl_s, c.max_ttl_s)
        per_token = self.s_per_token if self.reload_s_per_token is None else min(self.s_per_token, self.reload_s_per_token)
        gain = self.queue_delay_s * self.eta + context_tokens * per_token
        return min(choose_ttl(sorted(samples), gain), c.max_ttl_s)

    def record_duration(self, tool: str | None, seconds: float) -> None:
        if tool is not None:
            history = self.durations.get(tool)
            if history is None:
                history = self.durations[tool] = collections.deque(maxlen=TOOL_HISTORY)
            history.append(seconds)
        self.pooled.append(seconds)

    # --- events (the runtime's) -------------------------------------------------------------
    def program_started(self, program_id: str, reserve_tokens: int | None) -> None:
        self._programs[program_id] = p = _Program(declared_reserve=reserve_tokens)
        self.send(StartProgram(program_id))
        if reserve_tokens:
            self._reserve(program_id, p, reserve_tokens)

    def call_submitted(self, program_id: str, now: float, last: bool = False) -> float | None:
        """Before the call reaches the engine: learn the gap it ends, and set the TTL its end will pin; that TTL
        (0: none; None: the program is not retained)."""
        p = self._programs.get(program_id)
        if p is None:
            return None
        if p.last_call_end is not None:
            self.continued += 1
            self.record_duration(p.last_tool, max(0.0, now - p.last_call_end))
            p.last_call_end = None
        if last or not self.config.ttl:
            ttl = 0.0
        else:
            ttl = p.tool_ttl_s if p.tool_ttl_s is not None else self.ttl_for(p.last_tool, p.context_tokens)
        self.send(Pin(program_id, ttl))
        return ttl

    def tool_started(self, program_id: str, tool: str, ttl_s: float | None) -> None:
        """The program runs `tool` now (in-process `@agentrt.tool`, or named over HTTP): re-time its pin."""
        p = self._programs.get(program_id)
        if p is None:
            return
        p.last_tool, p.tool_ttl_s = tool, ttl_s
        if self.config.ttl:
            self.send(Pin(program_id, ttl_s if ttl_s is not None else self.ttl_for(tool, p.context_tokens)))

    def call_ended(self, program_id: str, now: float, *, tokens: int, computed_tokens: int, service_s: float,
                   wait_s: float) -> None:
        """A call ended: update the running means and the program's context (and its reservation)."""
        self.calls += 1
        self.queue_delay_s += (wait_s - self.queue_delay_s) / min(self.calls, 100)
        if computed_tokens > 0 and service_s > 0:
            self.s_per_token += (service_s / computed_tokens - self.s_per_token) / min(self.calls, 100)
        p = self._programs.get(program_id)
        if p is None:
            return
        p.calls += 1
        p.growth_tokens = max(0, tokens - p.context_tokens) if p.context_tokens else 0
        p.context_tokens = tokens
        p.last_call_end = now
        if self.config.auto_reserve and p.declared_reserve is None:
            self._reserve(program_id, p, tokens + p.growth_tokens)

    def program_ended(self, program_id: str) -> None:
        p = self._programs.pop(program_id, None)
        if p is not None:
            self._reserved -= p.reserve_tokens
        self.send(EndProgram(program_id))

    def release(self, program_id: str) -> None:
        """Drop the program's pins now (its last call is done)."""
        self.send(Release(program_id))

    def _reserve(self, program_id: str, p: _Program, tokens: int) -> None:
        cap = int(self.cache_tokens * self.config.max_reserved_fraction)
        tokens = max(0, min(tokens, cap - (self._reserved - p.reserve_tokens)))
        if tokens != p.reserve_tokens:
            self._reserved += tokens - p.reserve_tokens
            p.reserve_tokens = tokens
            self.send(Reserve(program_id, tokens))

