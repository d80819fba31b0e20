"""Program-affinity routing among replicas: a pure function of (the call, the replicas' stats, where
each program lives), so a Ray Serve router and the simulator run the same code.

    decision = route(call_program_id, prompt_tokens, replicas, homes.get(pid), config)   # the rule alone
    decision = homes.route(pid, prompt_tokens, loads, config, now=now)  # with the router's memory: live programs
                                           # counted, the home remembered (a program's end forgets it)
    decision.ranked                        # [[first choice], [then these], ...] as Ray's routers rank

The rule, after Autellix (arXiv 2502.13965, §4.3), then fitted to agents:

- Autellix sends a call of at most ~2,048 prompt tokens to the least-loaded engine and a longer one
  to the engine its program was placed on at its first long call. An agent's later calls extend its
  earlier context, which sits in its home replica's prefix cache and TTL pin, so here every call of
  at least `sticky_tokens` prompt tokens (0 by default: every call) goes to its program's home, and
  the first such call places the program. `sticky_tokens=2048` is Autellix's rule.
- Placement: where the fewest live programs are, then by load. Autellix places by load alone, but a
  replica's queue at the instant a program starts says little about the calls its programs in tool gaps
  are about to make: placing by live programs spreads the work that will come, not the work that is
  there. Live: running a call, or idle for at most the 90th percentile of the tool gaps seen so far
  (`ProgramHomes.call_started` / `call_done`: what the Ray router hears as calls are sent and end), so a
  finished program stops counting within a typical tool gap; a caller that reports neither counts the
  programs routed within `active_s`.
- The load guard (SGLang's router rebalances only past an absolute and a relative threshold): a
  home whose load is over `max_load` calls and over `max_load_ratio` times the least-loaded
  replica's (+1) is skipped; the call goes to the least-loaded replica and the program moves there
  (its context is computed once there, rather than queueing behind a hot replica for every call).
- A home that is gone (dead, drained, not among the candidates) re-homes the program on its next
  call the same way. Calls without a program go to the least-loaded replica.

Ties between equally loaded replicas break by a stable hash of the call's key, so equal replicas
share new programs instead of all landing on the first one.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """What the router knows of one replica when a call arrives."""

    replica_id: str
    load: int  # calls queued or running on it (Ray probes queue lengths per request)
    alive: bool = True  # False: dead or draining, never chosen
    programs: int = 0  # live programs on it (running a call or in a tool gap: each will call again), what a
    # new program is placed by (ProgramHomes.active)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    sticky_tokens: int = 0  # calls with at least this many prompt tokens go home (Autellix: 2048)
    max_load: int = 8  # the guard's absolute threshold: a home is overloaded only above this load ...
    max_load_ratio: float = 2.0  # ... and above this many times the least-loaded replica's load + 1
    active_s: float = 30.0  # the longest a program counts as live on its home after its last call (placement)

    def __post_init__(self) -> None:
        if not isinstance(self.sticky_tokens, int) or self.sticky_tokens < 0:
            raise ValueError(f"RouterConfig.sticky_tokens must be an int >= 0, got {self.sticky_tokens!r}")
        if not isinstance(self.max_load, int) or self.max_load < 0:
            raise ValueError(f"RouterConfig.max_load must be an int >= 0, got {self.max_load!r}")
        if not isinstance(self.max_load_ratio, (int, float)) or not self.max_load_ratio >= 1:
            raise ValueError(f"RouterConfig.max_load_ratio must be a number >= 1, got {self.max_load_ratio!r}")
        if not isinstance(self.active_s, (int, float)) or not self.active_s > 0:
            raise ValueError(f"RouterConfig.active_s must be a number > 0, got {self.active_s!r}")


@dataclass(frozen=True, slots=True)
class Decision:
    ranked: list[list[str]]  # replica ids, best rank first (empty: no replica alive)
    home: str | None  # the program's home after this call (None: no program, or not placed)
    reason: str  # "home" | "placed" | "rehomed-overload" | "rehomed-gone" | "least-loaded" | "none"


def route(program_id: str | None, prompt_tokens: int, replicas: Sequence[ReplicaStats], home: str | None,
          config: RouterConfig = RouterConfig(), key: str = "") -> Decision:
    """Where a call goes. `home`: the replica its program lives on (None: not placed yet); `key`: what
    breaks ties among equally loaded replicas (the program id, else the request's id)."""
    alive = [r for r in replicas if r.alive]
    if not alive:
        return Decision([], home, "none")
    order = _least_loaded(alive, key or program_id or "")
    least = order[0]
    rest = [[r.replica_id] for r in order]
    if program_id is None:
        return Decision(rest, None, "least-loaded")
    if prompt_tokens < config.sticky_tokens:  # a short call: load first, its program stays where it is
        return Decision(rest, home, "least-loaded")
    current = next((r for r in alive if r.replica_id == home), None)
    if current is None:  # placed where the fewest live programs are (then by load): its later calls follow
        spread = _fewest_programs(alive, key or program_id)
        return Decision([[r.replica_id] for r in spread], spread[0].replica_id,
                        "placed" if home is None else "rehomed-gone")
    if overloaded(current.load, least.load, config):
        return Decision(rest, least.replica_id, "rehomed-overload")
    others = [[r.replica_id] for r in order if r.replica_id != home]
    return Decision([[home], *others], home, "home")


def overloaded(load: int, least_load: int, config: RouterConfig) -> bool:
    """The guard: over the absolute threshold and over the ratio to the least-loaded replica."""
    return load > config.max_load and load > config.max_load_ratio * (least_load + 1)


def _tie(key: str, replica_id: str) -> bytes:
    """A stable hash of `key` with a replica's id: rendezvous hashing breaks ties (a CRC would order similar
    keys alike)."""
    return hashlib.blake2b(f"{key}|{replica_id}".encode(), digest_size=8).digest()


def _least_loaded(replicas: list[ReplicaStats], key: str) -> list[ReplicaStats]:
    return sorted(replicas, key=lambda r: (r.load, _tie(key, r.replica_id)))


def _fewest_programs(replicas: list[ReplicaStats], key: str) -> list[ReplicaStats]:
    return sorted(replicas, key=lambda r: (r.programs, r.load, _tie(key, r.replica_id)))


class _Home:
    __slots__ = ("ended", "inflight", "replica", "routed")

    def __init__(self, replica: str, routed: float) -> None:
        self.replica, self.routed, self.ended, self.inflight = replica, routed, None, 0
        # ended: when its last call ended (None: never heard of); inflight: its calls running now

    def last(self) -> float:
        return self.routed if self.ended is None else max(self.routed, self.ended)


GAPS_KEPT = 512  # tool gaps (a call's end -> its program's next call) the live-program window is fitted to
GAP_QUANTILE = 0.9  # a program idle for longer than this quantile of the gaps seen counts as gone ...
MIN_GAPS = 16  # ... once this many gaps were seen (before: RouterConfig.active_s)


class ProgramHomes:
    """The router's memory of where each program lives: bounded (least recently active dropped first),
    forgotten at the program's end or when its replica goes. With `call_started` / `call_done` (what a Ray
    router hears when it sends a call and when the call ends) it also knows which programs are running a
    call and how long programs sit in tool gaps, so `active` counts the programs that will call again soon
    rather than every program routed within `RouterConfig.active_s` (finished ones included)."""

    def __init__(self, capacity: int = 100_000) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"ProgramHomes capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._homes: collections.OrderedDict[str, _Home] = collections.OrderedDict()  # least recently active first
        self._running: collections.Counter[str] = collections.Counter()  # replica -> its programs with a call running
        self._gaps: collections.deque[float] = collections.deque(maxlen=GAPS_KEPT)

    def get(self, program_id: str | None) -> str | None:
        found = self._homes.get(program_id) if program_id is not None else None
        return found.replica if found is not None else None

    def set(self, program_id: str | None, replica_id: str | None, now: float = 0.0) -> None:
        if program_id is None:
            return
        if replica_id is None:
            self.forget(program_id)
            return
        home = self._homes.get(program_id)
        if home is None:
            home = self._homes[program_id] = _Home(replica_id, now)
        elif home.replica != replica_id:
            if home.inflight:
                self._running[home.replica] -= 1
                self._running[replica_id] += 1
            home.replica = replica_id
        home.routed = now
        self._homes.move_to_end(program_id)
        while len(self._homes) > self.capacity:
            self._drop(self._homes.popitem(last=False)[1])

    def call_started(self, program_id: str | None, now: float) -> None:
        """A call of the program was sent (to its home): it is running, and the tool gap it ends is measured."""
        home = self._homes.get(program_id) if program_id is not None else None
        if home is None:
            return
        if home.inflight == 0:
            if home.ended is not None:
                self._gaps.append(max(0.0, now - home.ended))
            self._running[home.replica] += 1
        home.inflight += 1

    def call_done(self, program_id: str | None, now: float) -> None:
        """A call of the program ended (any way)."""
        home = self._homes.get(program_id) if program_id is not None else None
        if home is None or home.inflight == 0:
            return
        home.inflight -= 1
        if home.inflight == 0:
            self._running[home.replica] -= 1
        home.ended = now
        self._homes.move_to_end(program_id)

    def _drop(self, home: _Home) -> None:
        if home.inflight:
            self._running[home.replica] -= 1

    def forget(self, program_id: str) -> None:
        home = self._homes.pop(program_id, None)
        if home is not None:
            self._drop(home)

    def replica_gone(self, replica_id: str) -> int:
        """Drop the homes on a replica that is gone (its programs re-home on their next call); how many."""
        gone = [p for p, h in self._homes.items() if h.replica == replica_id]
        for p in gone:
            self.forget(p)
        self._running.pop(replica_id, None)
        return len(gone)

    def __len__(self) -> int:
        return len(self._homes)

    def counts(self) -> dict[str, int]:
        """Programs per replica."""
        return dict(collections.Counter(h.replica for h in self._homes.values()))

    def gap_window(self, window_s: float) -> float:
        """How long an idle program counts as live: the GAP_QUANTILE of the tool gaps seen (at most `window_s`;
        `window_s` until MIN_GAPS were seen)."""
        if len(self._gaps) < MIN_GAPS:
            return window_s
        ordered = sorted(self._gaps)
        return min(window_s, ordered[min(len(ordered) - 1, int(GAP_QUANTILE * len(ordered)))])

    def route(self, program_id: str | None, prompt_tokens: int, loads: Mapping[str, int], config: RouterConfig,
              *, key: str = "", now: float = 0.0, hint: str | None = None) -> Decision:
        """`route` over this memory: the program's home (else `hint`), the live programs per replica when it is
        placed, the decision remembered. `loads`: replica id -> its load, the live replicas only."""
        home = self.get(program_id) or hint
        placing = program_id is not None and home not in loads  # a new program, or one whose replica is gone
        live = self.active(now, config.active_s) if placing else {}
        stats = [ReplicaStats(rid, load, programs=live.get(rid, 0)) for rid, load in loads.items()]
        d = route(program_id, prompt_tokens, stats, home, config, key=key)
        self.set(program_id, d.home, now)
        return d

    def active(self, now: float, window_s: float) -> collections.Counter[str]:
        """Live programs per replica: those running a call, those idle for at most `gap_window(window_s)` since
        their last call ended (in a tool gap: each will call again), and those routed within `window_s` whose
        calls were never heard to start or end (a caller without `call_started` / `call_done`). Walks only the
        recently active, newest first."""
        out = collections.Counter({r: n for r, n in self._running.items() if n > 0})
        gap = self.gap_window(window_s)
        for pid in reversed(self._homes):
            home = self._homes[pid]
            if now - home.last() > window_s:
                break
            if home.inflight:
                continue  # counted above
            if home.ended is None or home.routed > home.ended:
                live = now - home.routed <= window_s
            else:
                live = now - home.ended <= gap
            if live:
                out[home.replica] += 1
        return out
