"""The scheduling-policy seam.

The scheduler owns mechanism (budgets, blocks, preemption); a `SchedulingPolicy` owns order.
Each step the scheduler asks the policy for every running and waiting request's `priority`
(smaller runs sooner), serves running requests in that order, then admits waiting ones, and
picks preemption victims from the worst priority. A `preemptive` policy additionally lets a
waiting request displace a running one of worse priority when there is no room for it. The
runtime tells the policy when a program ends (`end_program`).

The engine ships `FCFS`; program-aware policies (PLAS, ATLAS, MLFQ) live in `agentrt` and
register themselves with `register_policy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from agentrt.engine.request import Request


class SchedulingPolicy(ABC):
    name: ClassVar[str]
    preemptive: ClassVar[bool] = False  # may a better waiting request displace a running one
    displaces_for_seats: bool = False  # without `preemptive`: a better waiting request displaces the worst running
    # one when the running set is full (a seat, never blocks: a capped running set stays in policy order)
    pinned_first: bool = False  # waiting calls of programs whose KV is pinned go ahead of all others
    # (Continuum's order: a program resuming from a tool call finds its context and keeps it)
    protect_pins: bool = False  # admission control for a KV-bound engine: while others run, a waiting call
    # is admitted only if its whole prompt and output fit, and only a call of a program holding a pin may
    # make others' pins give way (a new program waits instead of evicting a paused one's context)
    admit_output_tokens: int | None = None  # with protect_pins: the output that must fit at admission, at most
    # this many tokens of max_tokens (None: all of it; a call without max_tokens would then need the whole context)
    pins_by_rank: bool = False  # with protect_pins: a waiting call of a program holding a pin may make the pins of
    # exactly the programs it `outranks` give way (instead of anyone's)
    new_take_pins: bool = False  # with protect_pins and pins_by_rank: a call of a program holding no pin (a new
    # program) may make the pins of the programs it `outranks` give way too (else it takes nobody's)
    yields_prefill: bool = False  # while calls wait for KV blocks, the prompt chunks of calls ranked below a call
    # decoding in the step (or waiting) get only the share of the step `prefill_yield` gives them (`yields_to`)
    keeps_headroom: bool = False  # admission leaves room for better-ranked calls: while others run, a call the
    # policy says `leaves_headroom` goes in only if the blocks a typical better call needs stay free after it
    # (the scheduler fits that size from the calls it admits that do not leave headroom)
    backfill_s: float | None = None  # KV-bound admission: while the best waiting call that does not fit has waited
    # less than this many seconds, calls behind it that fit go in; after that the line waits for it (None: the line
    # always waits for its head, FCFS's head-of-line order)

    def on_arrival(self, req: Request, now: float) -> None:
        """A request entered the waiting queue for the first time."""

    def before_schedule(self, waiting: Sequence[Request], running: Sequence[Request], now: float) -> None:
        """Called at the start of every step (promotions, aging)."""

    @abstractmethod
    def priority(self, req: Request) -> Any:
        """Sort key: smaller is served first. Must be total and stable (end with arrival, id)."""

    def pinned_key(self, req: Request, pinned: bool) -> Any:
        """The waiting order under `pinned_first` (`pinned`: the request's program holds pinned KV): pinned
        programs' calls ahead of all others, then `priority`. A policy with coarse classes may keep its
        classes first and put pinned calls ahead only within one."""
        return (not pinned, self.priority(req))

    def on_step(self, reqs: Sequence[Request], service_s: Sequence[float], num_tokens: Sequence[int], now: float) -> None:
        """After a model step: the requests it served, the executor time attributed to each, tokens each."""

    def on_preempt(self, req: Request, now: float) -> None:
        """`req` lost its blocks and went back to waiting."""

    def on_finish(self, req: Request, now: float) -> None:
        """`req` finished (any reason), including aborts and errors."""

    def end_program(self, program_id: str) -> None:
        """The program is over: per-program state may go once its last request leaves. Called from
        any thread (the runtime's), so an implementation should only queue the id for its next hook.
        A policy keeping per-program state must also bound it without this call (an engine used
        without agentrt's runtime never makes it)."""

    def max_running(self, waiting: Sequence[Request], running: Sequence[Request], max_num_seqs: int) -> int | None:
        """The running set this step may have (the scheduler takes the smaller of it and `max_num_seqs`):
        admission stops there, and under a preemptive policy a better waiting call displaces the worst
        running one at it. Called each step after `before_schedule`. None (the default): `max_num_seqs`."""
        return None

    def credit_service(self, program_id: str, attained: float, critical: float) -> None:
        """The service `program_id` has received outside this engine (on other replicas), as totals:
        `attained` (summed) and `critical` (the longest critical path there). Program-level policies
        order by it plus what they saw here; any thread, so queue it like `end_program`. Default: ignored."""

    def outranks(self, waiting: Request, program_id: str) -> bool:
        """With `pins_by_rank`: does `waiting` rank above program `program_id`, which has no call in the
        engine and holds pinned KV (so its pin may give way to it)? Default: no program is outranked."""
        return False

    def prefill_yield(self) -> int:
        """With `yields_prefill`: the prompt tokens a step gives, all together, to the calls that yield to a better
        one in it (`yields_to`), while calls wait for KV blocks: a better call's decode steps then do not carry a
        worse call's whole prompt chunk, it finishes and frees its blocks sooner, and a better waiting call finds
        the token budget."""
        raise NotImplementedError

    def yields_to(self, prefilling: Request, better: Request) -> bool:
        """With `yields_prefill`: does `prefilling`'s prompt chunk yield to `better` (decoding in the same step, or
        waiting)? Default: when `better` ranks above it."""
        return self.priority(better) < self.priority(prefilling)

    def leaves_headroom(self, req: Request) -> bool:
        """With `keeps_headroom`: must `req` leave room in the KV cache for better-ranked calls (it ranks in the
        policy's lowest class)? Default: no."""
        return False

    def displaces(self, waiting: Request, running: Request) -> bool:
        """Preemptive policies: may `waiting` take `running`'s place? Recompute preemption is not
        free, so a policy with coarse classes (queues) should answer by class, not by full key."""
        return self.priority(waiting) < self.priority(running)

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        """Which running request to preempt when blocks run out: the worst priority by default."""
        return max(candidates, key=self.priority)


class FCFS(SchedulingPolicy):
    """First come, first served (vLLM's default): order by arrival; preempt the latest arrival.
    `pinned_first=True`: calls of programs holding pinned KV first, then by arrival (Continuum's order);
    `protect_pins=True`: the admission control of the same name (above)."""

    name = "fcfs"

    def __init__(self, *, pinned_first: bool = False, protect_pins: bool = False) -> None:
        self.pinned_first = pinned_first
        self.protect_pins = protect_pins

    def priority(self, req: Request) -> tuple[float, str]:
        return (req.arrival_time, req.request_id)


_REGISTRY: dict[str, Callable[..., SchedulingPolicy]] = {"fcfs": FCFS}


def register_policy(name: str, factory: Callable[..., SchedulingPolicy]) -> None:
    _REGISTRY[name] = factory


def make_policy(policy: str | SchedulingPolicy | None, **kwargs: Any) -> SchedulingPolicy:
    """A policy instance from a name, or the instance itself."""
    if policy is None:
        return FCFS()
    if isinstance(policy, SchedulingPolicy):
        return policy
    try:
        factory = _REGISTRY[policy]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {policy!r}; known: {sorted(_REGISTRY)}") from None
    return factory(**kwargs)
