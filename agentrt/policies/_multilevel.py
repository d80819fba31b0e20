"""Discretized multi-level queues: the mechanism PLAS, ATLAS and MLFQ share.

K queues; queue i holds calls of priority level i (0 = served first). Within a queue calls are
FCFS by the time they entered it. A call that receives its queue's time quantum of service drops
one level (and goes to the back of that queue); a starving call is promoted to queue 0. Subclasses
decide the entry level of a new call, what counts as starving, and what a finished call teaches
them. The sort key the engine sees is `(level, entered_at, arrival_time, request_id)`.

Service is measured in one of two units (`service=`):

- ``"time"`` — model-executor seconds the engine attributes to the call: a step's wall time split
  across the requests it served in proportion to the tokens each computed in that step (a 500-token
  prefill chunk and three decodes in one 0.2 s step get 0.2 * 500/503 s and 0.2 * 1/503 s each).
  No queueing time, no tool time.
- ``"tokens"`` — `token_cost` units per token computed. Deterministic, for tests and simulation.

Thread safety: the engine calls every hook from its step thread. The only method meant for other
threads are `end_program`, which queues the id (the step thread drops the state on its next step),
and `credit_service`, which queues a program's service on other replicas the same way.

Bounded state: a program's state lives while it has calls in the engine and until the runtime ends
it. An engine used without agentrt's runtime never ends programs, so a program with no call in the
engine is also dropped after `idle_ttl_s` (policy clock), and at most `max_idle_programs` idle
programs are kept (least recently active dropped first). Such a program never says it ended, so for the
fits that learn from finished programs (PLAS's first boundary in programs' worth) one that stays quiet well
past the gaps programs usually come back after is presumed finished (`quiet_s`) while its state is kept. A
program that calls again after `idle_ttl_s` starts from fresh state, as if new: it may get ahead of where its history would put it, which is a
fairness loss for one call, never a stall or a leak. Ten minutes is far above the tool gaps of agent
programs (seconds), and 10k idle records are a few MB.
"""

from __future__ import annotations

import bisect
import collections
import math
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from agentrt._errors import ConfigError
from agentrt.engine.policy import SchedulingPolicy
from agentrt.engine.request import Request

ServiceUnit = Literal["time", "tokens"]
DEFAULT_YIELD_TOKENS = 128  # `prefill_yield` until the step cost is fitted
_STATE_KEY = "agentrt"


@dataclass(slots=True)
class CallState:
    """Per-call scheduling state, kept in `req.policy_state["agentrt"]`."""

    level: int  # current queue, 0 = highest priority
    entered_at: float  # when it entered its current queue: FCFS within a queue
    quantum_used: float = 0.0  # service received since it entered the current queue
    wait: float = 0.0  # W_call: time spent waiting since arrival or the last promotion (MLFQ: since last
    # served); for program-level policies only while no call of its program was running
    service: float = 0.0  # T_call: service since arrival or the last promotion
    total_service: float = 0.0  # all service received by the call, never reset
    start_priority: float = 0.0  # the program's priority when the call arrived (ATLAS)
    last_seen: float = 0.0  # `now` of the latest hook that looked at the call (wait accounting)
    promotions: int = 0  # times anti-starvation moved it to the top
    program_start: float = 0.0  # when its program's first call arrived (order within a queue)


@dataclass(slots=True)
class ProgramState:
    """Per-program scheduling state (a request without a program is its own program)."""

    attained: float = 0.0  # PLAS: Σ service of the program's completed calls
    critical: float = 0.0  # ATLAS: longest critical path of service seen so far
    wait: float = 0.0  # W_program: time it had calls waiting and none running (live; see before_schedule)
    in_flight: float = 0.0  # service received so far by its calls still in the engine
    live_critical: float = 0.0  # ATLAS: `critical` counting the calls still in the engine
    active: int = 0  # calls of the program currently in the engine
    start: float | None = None  # arrival of its first call
    ended: bool = False  # the runtime said the program is over: drop once `active` reaches 0
    elsewhere: float = 0.0  # service its calls received on other engines (replicas): `credit_service`
    elsewhere_critical: float = 0.0  # ATLAS: the longest critical path seen on other engines
    presumed: bool = False  # gone quiet past its program's usual gaps: counted as finished (see `quiet_s`)


def doubling(first: float, count: int) -> list[float]:
    """`[first, 2*first, 4*first, ...]`, `count` values."""
    return [first * (1 << i) for i in range(count)]


class MultiLevelPolicy(SchedulingPolicy):
    """Base of the discretized-queue policies; see the module docstring."""

    preemptive: ClassVar[bool] = True
    program_level: ClassVar[bool] = True  # False: calls are scheduled on their own (MLFQ)
    order_by_program: bool = False  # within a queue: older programs first (else calls by entry time)
    idle_ttl_s: float = 600.0  # state of a program with no call in the engine is dropped after this
    max_idle_programs: int = 10_000  # idle programs whose state is kept at most (least recently active go first)
    quiet_gaps: float = 4.0  # a program idle this many times the 90th percentile of programs' gaps between calls
    min_quiet_s: float = 1.0  # (and at least this long) is presumed finished (`quiet_s`)
    default_quiet_s: float = 10.0  # ... until 8 gaps were seen

    def __init__(self, *, num_queues: int, quantum: float, service: ServiceUnit, token_cost: float,
                 preempt: bool | str = True, pinned_first: bool = False, victim: str = "priority",
                 protect_pins: bool = False, running_cap: int | str | None = None,
                 cap_efficiency: float = 0.9, pins_by_rank: bool = False, new_take_pins: bool = False,
                 headroom: bool = False, prefill_yield: bool | int = False, yield_to: str = "rank",
                 backfill_s: float | None = None) -> None:
        if not isinstance(num_queues, int) or num_queues < 1:
            raise ConfigError(f"{self.name}: num_queues must be an integer >= 1, got {num_queues!r}")
        if not quantum > 0:
            raise ConfigError(f"{self.name}: quantum must be > 0, got {quantum!r}")
        if service not in ("time", "tokens"):
            raise ConfigError(f"{self.name}: service must be 'time' or 'tokens', got {service!r}")
        if not token_cost > 0:
            raise ConfigError(f"{self.name}: token_cost must be > 0, got {token_cost!r}")
        if preempt not in (True, False, "seats"):
            raise ConfigError(f"{self.name}: preempt must be true, false or 'seats', got {preempt!r}")
        if victim not in ("priority", "newest"):
            raise ConfigError(f"{self.name}: victim must be 'priority' or 'newest', got {victim!r}")
        if not (running_cap is None or running_cap == "auto" or (isinstance(running_cap, int) and running_cap >= 1)):
            raise ConfigError(f"{self.name}: running_cap must be None, 'auto' or an int >= 1, got {running_cap!r}")
        if not 0 < cap_efficiency < 1:
            raise ConfigError(f"{self.name}: cap_efficiency must be in (0, 1), got {cap_efficiency!r}")
        if not (isinstance(prefill_yield, bool) or (isinstance(prefill_yield, int) and prefill_yield >= 1)):
            raise ConfigError(f"{self.name}: prefill_yield must be true, false or an int >= 1, got {prefill_yield!r}")
        if backfill_s is not None and (isinstance(backfill_s, (bool, str)) or not backfill_s >= 0):
            raise ConfigError(f"{self.name}: backfill_s must be None or a number of seconds >= 0, got {backfill_s!r}")
        self.backfill_s = backfill_s  # engine.scheduler: calls that fit go in behind a head that does not, a while
        self.yield_tokens = prefill_yield if num_queues > 1 else False  # see `prefill_yield`
        self.yields_prefill = self.yield_tokens is not False
        if yield_to not in ("rank", "queue"):
            raise ConfigError(f"{self.name}: yield_to must be 'rank' or 'queue', got {yield_to!r}")
        self.yield_by_queue = yield_to == "queue"
        self.running_cap = running_cap  # the running set while calls wait: see `max_running`
        # a better waiting call displaces the worst running one for a seat, never for blocks: with a cap (the capped
        # set stays in order), or with preempt="seats" (the displaced call's blocks stay cached, so it resumes with a
        # prefix hit; taking blocks from it instead would evict them and recompute them)
        self.displaces_for_seats = running_cap is not None or preempt == "seats"
        self.step_fit = StepFit(cap_efficiency)
        self.preemptive = preempt is True  # False: order waiting calls only, never displace running ones for blocks
        self.pinned_first = pinned_first  # calls of programs holding pinned KV go first (engine.scheduler)
        self.protect_pins = protect_pins  # admission keeps paused programs' pinned KV (engine.scheduler)
        self.pins_by_rank = pins_by_rank  # with protect_pins: pins give way to the calls that outrank their program
        self.new_take_pins = new_take_pins  # with pins_by_rank: a new program's call too (engine.scheduler)
        self.keeps_headroom = headroom and num_queues > 1  # calls of the last queue leave room for better ones
        self.victim = victim  # "newest": preempt a call of the latest-started program, whatever its queue
        self.num_queues = num_queues
        self.quanta = doubling(quantum, num_queues - 1) + [float("inf")]  # the last queue never demotes
        self.service_unit: ServiceUnit = service
        self.token_cost = token_cost
        self.programs: dict[str, ProgramState] = {}
        self._ended: collections.deque[str] = collections.deque()
        self._credits: collections.deque[tuple[str, float, float]] = collections.deque()
        self._idle: collections.OrderedDict[str, float] = collections.OrderedDict()  # program key -> when its
        # last call left, oldest first: programs in `programs` with no call in the engine
        self._quiet: collections.OrderedDict[str, float] = collections.OrderedDict()  # the idle programs not yet
        # presumed finished, oldest first
        self._gaps: collections.deque[float] = collections.deque(maxlen=256)  # programs' latest idle gaps
        self._quiet_s = self.default_quiet_s

    # --- subclass hooks ---------------------------------------------------------------------
    @abstractmethod
    def entry_level(self, req: Request, prog: ProgramState, st: CallState) -> int:
        """The queue a new call enters."""

    def starving(self, prog: ProgramState, st: CallState) -> bool:
        return False

    def on_call_done(self, prog: ProgramState, st: CallState) -> None:
        """Fold a finished call into its program's state."""

    def on_program_done(self, prog: ProgramState) -> None:
        """A program is over (the runtime ended it, or a request without a program finished) and its last call
        has left; its state is dropped next."""

    def floor_level(self, prog: ProgramState, st: CallState) -> int:
        """The highest queue the call may sit in now (0 = no floor); checked after every step it is
        served in and, for waiting calls, before every schedule."""
        return 0

    def program_queue(self, prog: ProgramState | None) -> int | None:
        """The queue a new call of the program would enter now, `num_queues` for a program without state (ended, or
        idle past `idle_ttl_s`: it ranks last); None: the policy ranks calls, not programs."""
        return None

    # --- queries ------------------------------------------------------------------------------
    @staticmethod
    def program_key(req: Request) -> str:
        return req.program_id if req.program_id is not None else f"request:{req.request_id}"

    def state(self, req: Request) -> CallState:
        """The call's state; created on first sight if the engine skipped `on_arrival`."""
        st = req.policy_state.get(_STATE_KEY)
        if st is None:
            self.on_arrival(req, req.arrival_time)
            st = req.policy_state[_STATE_KEY]
        return st

    def level(self, req: Request) -> int:
        return self.state(req).level

    def priority(self, req: Request) -> tuple[Any, ...]:
        st = self.state(req)
        if self.order_by_program:
            return (st.level, st.program_start, st.entered_at, req.arrival_time, req.request_id)
        return (st.level, st.entered_at, req.arrival_time, req.request_id)

    def pinned_key(self, req: Request, pinned: bool) -> tuple[Any, ...]:
        """`pinned_first` within a queue only: a program resuming from a tool call with its KV pinned goes
        ahead of its queue, never ahead of a better queue (a tree search's pinned branches would otherwise
        keep every newly arrived short program waiting, whatever its service)."""
        key = self.priority(req)
        return (key[0], not pinned, *key[1:])

    def outranks(self, waiting: Request, program_id: str) -> bool:
        """`pins_by_rank`: a waiting call outranks a paused program (one holding pinned KV, no call in the engine)
        whose next call would enter a worse queue, or the same queue behind it by program age (`order="program"`).
        A program whose state is gone (ended, or idle past `idle_ttl_s`) ranks last."""
        prog = self.programs.get(program_id)
        level = self.program_queue(prog)
        if level is None:
            return False
        st = self.state(waiting)
        if prog is None or st.level != level:
            return st.level < level
        return self.order_by_program and prog.start is not None and st.program_start < prog.start

    def leaves_headroom(self, req: Request) -> bool:
        """`headroom`: a call of the last queue leaves free the blocks a better call typically needs (engine.scheduler)."""
        return self.state(req).level >= self.num_queues - 1

    def prefill_yield(self) -> int:
        """`prefill_yield`: the prompt tokens per step of the calls that yield to a better one (engine.scheduler). An
        int: that many. True: the smallest chunk with `cap_efficiency` of a long chunk's prompt throughput on this
        engine's measured step cost a + c * tokens (`StepFit.chunk`), `DEFAULT_YIELD_TOKENS` until fitted."""
        if self.yield_tokens is True:
            return self.step_fit.chunk() or DEFAULT_YIELD_TOKENS
        return self.yield_tokens

    def yields_to(self, prefilling: Request, better: Request) -> bool:
        """`prefill_yield`'s order: a prompt chunk yields to a call ranked above it (`yield_to="rank"`), or only to a
        call of a better queue (`"queue"`)."""
        if self.yield_by_queue:
            return self.level(better) < self.level(prefilling)
        return self.priority(better) < self.priority(prefilling)

    def displaces(self, waiting: Request, running: Request) -> bool:
        """Only a call of a strictly higher queue displaces a running one: within a queue the order
        is FCFS, and preempting for a tie would only trade one recompute for another."""
        return self.level(waiting) < self.level(running)

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        """From the lowest queue, the call that entered it last; with `victim="newest"` a call of the
        latest-started program (the least invested: a long program's context is the costliest recompute)."""
        if self.victim == "newest":
            return max(candidates, key=self._newest_key)
        return max(candidates, key=self.priority)

    def _newest_key(self, req: Request) -> tuple[float, float, str]:
        return (self.state(req).program_start, req.arrival_time, req.request_id)

    # --- engine hooks ------------------------------------------------------------------------
    def on_arrival(self, req: Request, now: float) -> None:
        key = self.program_key(req)
        prog = self.programs.get(key)
        if prog is None:
            prog = self.programs[key] = ProgramState()
        since = self._idle.pop(key, None)
        if since is not None and self._quiet.pop(key, None) is not None:  # back before presumed finished: a gap
            self._gaps.append(now - since)
            if len(self._gaps) >= 8 and len(self._gaps) % 8 == 0:
                p90 = sorted(self._gaps)[(len(self._gaps) * 9) // 10]
                self._quiet_s = max(self.min_quiet_s, self.quiet_gaps * p90)
        prog.presumed = False
        prog.active += 1
        if prog.start is None:
            prog.start = now
        st = CallState(level=0, entered_at=now, last_seen=now, program_start=prog.start)
        st.level = min(max(self.entry_level(req, prog, st), 0), self.num_queues - 1)
        req.policy_state[_STATE_KEY] = st

    def before_schedule(self, waiting: Sequence[Request], running: Sequence[Request], now: float) -> None:
        while self._ended:
            key = self._ended.popleft()
            prog = self.programs.get(key)
            if prog is not None:
                prog.ended = True
                if prog.active <= 0:
                    if not prog.presumed:
                        self.on_program_done(prog)
                    del self.programs[key]
                    self._idle.pop(key, None)
                    self._quiet.pop(key, None)
        while self._credits:
            key, attained, critical = self._credits.popleft()
            prog = self.programs.get(key)
            if prog is None:  # no call of it here yet: kept as an idle program until one comes
                prog = self.programs[key] = ProgramState()
                self._idle[key] = now
            prog.elsewhere, prog.elsewhere_critical = attained, critical
        self._expire_idle(now)
        self._presume_finished(now)
        for req in running:
            st = self.state(req)
            st.last_seen = now
            self._apply_floor(self._program(req), st, now)
        # W accrues while a call waits and its program has no call running: a program that is being
        # served is not starving, however many of its own parallel calls queue behind each other.
        # W_program counts each such stretch once, not once per waiting thread.
        served = {self.program_key(r) for r in running} if self.program_level else set()
        blocked: dict[str, float] = {}
        for req in waiting:
            st, key = self.state(req), self.program_key(req)
            dt = max(0.0, now - st.last_seen)
            st.last_seen = now
            if key not in served:
                st.wait += dt
                blocked[key] = max(blocked.get(key, 0.0), dt)
        for key, dt in blocked.items():
            self._program_by_key(key).wait += dt
        # One call of a starving program at a time (its best-ranked starving call), and only while none
        # of its calls runs: enough to keep it moving without lifting a whole fan-out of parallel calls
        # above everyone else. Request-level policies promote every starving call.
        chosen: dict[str, Request] = {}
        for req in waiting:
            st, key = self.state(req), self.program_key(req)
            if st.level > 0 and key not in served and self.starving(self._program(req), st):
                slot = key if self.program_level else req.request_id
                if slot not in chosen or self.priority(req) < self.priority(chosen[slot]):
                    chosen[slot] = req
        lifted = {id(r) for r in chosen.values()}
        for req in waiting:
            if id(req) in lifted:
                self.promote(req, now)
            else:
                self._apply_floor(self._program(req), self.state(req), now)

    def promote(self, req: Request, now: float) -> None:
        """Anti-starvation: move the call to the top queue; reset only the call's own W and T."""
        st = self.state(req)
        st.level, st.entered_at, st.quantum_used = 0, now, 0.0
        st.wait = st.service = 0.0
        st.promotions += 1

    def max_running(self, waiting: Sequence[Request], running: Sequence[Request], max_num_seqs: int) -> int | None:
        """The running-set cap (`running_cap`): only while calls wait (an engine with room for everyone runs
        everyone); a fixed size, or "auto": the knee of this engine's measured step cost (`StepFit`), the
        smallest batch with `cap_efficiency` of the throughput of a full one, so a wider batch would add
        little throughput and slow every call."""
        if self.running_cap is None or not waiting:
            return None
        if self.running_cap == "auto":
            return self.step_fit.knee(max_num_seqs)
        return self.running_cap

    def on_step(self, reqs: Sequence[Request], service_s: Sequence[float], num_tokens: Sequence[int], now: float) -> None:
        if self.running_cap == "auto" or self.yield_tokens is True:
            self.step_fit.add(sum(num_tokens), sum(service_s))
        tokens_mode = self.service_unit == "tokens"
        for req, secs, ntok in zip(reqs, service_s, num_tokens):
            st = self.state(req)
            cost = ntok * self.token_cost if tokens_mode else secs
            st.quantum_used += cost
            st.service += cost
            st.total_service += cost
            st.last_seen = now
            prog = self._program(req)
            prog.in_flight += cost
            prog.live_critical = max(prog.live_critical, st.start_priority + st.total_service)
            if st.quantum_used >= self.quanta[st.level]:
                st.level += 1
                st.entered_at, st.quantum_used = now, 0.0
        for req in reqs:  # after all of the step's service is counted: parallel calls move together
            self._apply_floor(self._program(req), self.state(req), now)

    def _apply_floor(self, prog: ProgramState, st: CallState, now: float) -> None:
        floor = min(self.floor_level(prog, st), self.num_queues - 1)
        if st.level < floor:
            st.level, st.entered_at, st.quantum_used = floor, now, 0.0

    def on_preempt(self, req: Request, now: float) -> None:
        self.state(req).last_seen = now

    def on_finish(self, req: Request, now: float) -> None:
        st = req.policy_state.get(_STATE_KEY)
        key = self.program_key(req)
        prog = self.programs.get(key)
        if st is None or prog is None:
            return
        prog.in_flight -= st.total_service
        self.on_call_done(prog, st)
        prog.active -= 1
        if prog.active <= 0:
            if prog.ended or req.program_id is None:
                if not prog.presumed:
                    self.on_program_done(prog)
                del self.programs[key]
            else:
                self._idle[key] = now
                self._idle.move_to_end(key)
                self._quiet[key] = now
                self._quiet.move_to_end(key)
                self._expire_idle(now)

    def _expire_idle(self, now: float) -> None:
        """Drop idle programs past `idle_ttl_s` or beyond `max_idle_programs` (see the module docstring)."""
        while self._idle:
            key, since = next(iter(self._idle.items()))
            if len(self._idle) <= self.max_idle_programs and now - since < self.idle_ttl_s:
                return
            del self._idle[key]
            self._quiet.pop(key, None)
            prog = self.programs.get(key)
            if prog is not None and prog.active <= 0:
                del self.programs[key]

    def quiet_s(self) -> float:
        """How long a program with no call in the engine stays quiet before it is presumed finished: `quiet_gaps`
        times the 90th percentile of the gaps programs came back after (tool calls, a user's next turn), at least
        `min_quiet_s`; `default_quiet_s` until 8 gaps were seen."""
        return self._quiet_s

    def _presume_finished(self, now: float) -> None:
        """A program quiet past `quiet_s` counts as finished for the fits (`on_program_done`): a client of the HTTP
        API (an OpenAI SDK, an agent framework) never says its program ended, and its state is kept for
        `idle_ttl_s` in case it comes back. If it does, its service goes on from where it was, and it is counted
        once more when it goes quiet (or ends) again."""
        while self._quiet:
            key, since = next(iter(self._quiet.items()))
            if now - since < self._quiet_s:
                return
            del self._quiet[key]
            prog = self.programs.get(key)
            if prog is not None and prog.active <= 0 and not prog.ended:
                prog.presumed = True
                self.on_program_done(prog)

    # --- runtime side ---------------------------------------------------------------------
    def end_program(self, program_id: str) -> None:
        """The program is over: forget its state once its last call leaves. Any thread."""
        self._ended.append(program_id)

    def credit_service(self, program_id: str, attained: float, critical: float) -> None:
        """The program's service on other replicas (totals, not increments). Any thread."""
        self._credits.append((program_id, float(attained), float(critical)))

    def _program(self, req: Request) -> ProgramState:
        return self._program_by_key(self.program_key(req))

    def _program_by_key(self, key: str) -> ProgramState:
        prog = self.programs.get(key)
        if prog is None:
            prog = self.programs[key] = ProgramState(active=1)
        return prog


RUNNING_CAP_FORMS = "'auto' or an integer >= 1"


def parse_running_cap(text: str) -> int | str:
    """A running cap as a command line gives it (`--running-cap`, `plas:running_cap=`): "auto" or an integer
    >= 1; ValueError naming the forms otherwise."""
    if text == "auto":
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"must be {RUNNING_CAP_FORMS}, got {text!r}")


class StepFit:
    """A step's time as a + c * tokens, fitted by least squares over the latest `window` steps (refitted
    every `every` steps), and the knee of throughput b / (a + c b): the smallest b with `efficiency` of
    the throughput at `max_num_seqs` rows, b >= f B a / (a + c B (1 - f)). None until `min_steps` steps
    of at least two sizes were seen, or while the fit says nothing (a fixed cost below one row's cost:
    nothing for a wider batch to amortize, or noise)."""

    def __init__(self, efficiency: float, window: int = 512, every: int = 32, min_steps: int = 32,
                 min_cap: int = 2) -> None:
        self.efficiency, self.every, self.min_steps, self.min_cap = efficiency, every, min_steps, min_cap
        self.samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self.coef: tuple[float, float] | None = None  # (a, c) of the latest fit
        self._since = 0

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self.samples.append((tokens, seconds))
        self._since += 1
        if self._since >= self.every and len(self.samples) >= self.min_steps:
            self._since = 0
            self.coef = self._fit()

    def _fit(self) -> tuple[float, float] | None:
        n = len(self.samples)
        mx = sum(x for x, _ in self.samples) / n
        my = sum(y for _, y in self.samples) / n
        sxx = sum((x - mx) ** 2 for x, _ in self.samples)
        if sxx <= 0:
            return self.coef
        c = sum((x - mx) * (y - my) for x, y in self.samples) / sxx
        return my - c * mx, c

    def chunk(self) -> int | None:
        """The smallest prompt chunk b with `efficiency` f of the throughput of an endless one: b c / (a + c b) >= f,
        b >= f a / (c (1 - f)); None until fitted, or while the fit says nothing (as for `knee`)."""
        if self.coef is None:
            return None
        a, c = self.coef
        if c <= 0 or a < c:
            return None
        return math.ceil(self.efficiency * a / (c * (1 - self.efficiency)))

    def knee(self, max_num_seqs: int) -> int | None:
        if self.coef is None:
            return None
        a, c = self.coef
        if c <= 0 or a < c:  # a fixed cost below one row's: nothing a wider batch amortizes, or a poor fit
            return None
        f, b = self.efficiency, max_num_seqs
        return max(self.min_cap, min(max_num_seqs, math.ceil(f * b * a / (a + c * b * (1 - f)))))


def queue_of(boundaries: Sequence[float], value: float) -> int:
    """Index of the queue `[lo_i, hi_i)` holding `value`, given the finite upper bounds `hi_i`."""
    return bisect.bisect_right(boundaries, value)
