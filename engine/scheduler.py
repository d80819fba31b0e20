"""Continuous batching by token counts.

Each step: running requests in policy order get `min(remaining, budget)` tokens (chunked prefill
falls out of this); then waiting requests are admitted in policy order with their cached prefix.
A waiting request whose next block a request of this step is computing (same content hash) waits a step
and then reads it from the prefix cache: requests that arrive together with a shared prefix (a system
prompt, an embedding instruction, parallel threads of a program) compute it once (in-batch prefix sharing).
When blocks run out, pinned blocks give way first, then others' unused reservations (for a running
request, or an otherwise idle engine), and only then is the policy's victim among the not-yet-served
running requests preempted (recompute: its full blocks stay in the prefix cache). A request that could
never fit fails alone. Expired pins are dropped at the start of every step (engine.ownership).

Priority classes (vLLM's request `priority`, SamplingParams.priority) come before any policy: a
request of a smaller class runs, is admitted and keeps its blocks before any of a larger one, and
one waiting without room displaces a running request of a larger class, whatever the policy; within a
class the policy orders as it would alone. With every request in class 0 (the default) nothing
changes.

Two policy switches concern pins (SchedulingPolicy attributes, False unless a policy sets them):
`pinned_first` puts waiting calls of programs holding a pin ahead of the others (Continuum's order; the
policy's `pinned_key` may keep its own classes first, as agentrt's queues do; not while a running-set cap
binds, when seats go in the policy's order);
`protect_pins` is admission control for a KV-bound engine: while others run, a waiting call goes in only
if its whole prompt and output fit (at most the policy's `admit_output_tokens` of the output), and only a call of a program that holds a pin may make other
programs' pins give way (with the policy's `pins_by_rank`, only those of the programs it `outranks`, and with
its `new_take_pins` a call of a program holding no pin may too; an idle engine admits as usual). agentrt's PLAS
takes these as arguments.

Headroom (a policy that `keeps_headroom`, agentrt's PLAS with `headroom=True`): while others run, a call the policy says
`leaves_headroom` (its lowest class: long programs) is admitted only if, after its whole prompt and output, the
blocks a better-ranked call typically needs stay free: the 90th percentile of what the latest better-ranked calls
needed beyond their prefix hits at admission (`HEADROOM_FIT` of them, once `HEADROOM_MIN` were seen; at most
half the cache). A new short program then finds its blocks free instead of waiting for the long calls that hold
them to finish (issue 47: displacing them would recompute their contexts).

Prompt share (a policy that `yields_prefill`, agentrt's PLAS): while calls wait for KV blocks (a call did not fit at
the latest step, or one was preempted for blocks), the prompt chunks of the calls ranked below a call decoding in the
step, or below one of the best waiting calls (`yields_to`), compute `prefill_yield()` tokens at most, all together.
A better call's decode steps then do not carry a worse call's whole prompt chunk: it finishes and frees its blocks
sooner, and a better waiting call finds the token budget (issue 47: simulated on the KV-bound agent mix, PLAS 0.69x
FCFS's mean latency without it, 0.50x with it). Without pressure on the blocks nothing changes.

Backfill (a policy with `backfill_s`, agentrt's PLAS and ATLAS): when the best waiting call does not fit in the KV
cache, the calls behind it that fit go in, in order, while it has waited for less than `backfill_s` seconds since it
arrived; after that the line waits for it (no call behind it takes the blocks that free up), so a large call is not
starved by small ones. Without it the line always waits for its head: on the KV-bound agent mix (issue 47) a step
program's next call that fitted beside its pinned context waited behind a new program's 36-block first call, with 33
blocks of 150 free on average while calls waited (simulated).

The running set: `max_num_seqs` seats, or fewer while the policy's `max_running` says so (a running-set
cap: admission stops at it, and a preemptive policy's better waiting call displaces the worst running
one there; a policy that `displaces_for_seats` without being preemptive displaces for a seat only, never
for blocks); requests already running above a lowered cap finish as usual.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agentrt.engine.config import EngineConfig
from agentrt.engine.kv_cache_manager import KVCacheManager
from agentrt.engine.kv_tiers import Moves
from agentrt.engine.policy import SchedulingPolicy
from agentrt.engine.program_ops import EndProgram, ProgramOp
from agentrt.engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    reqs: list[Request]  # requests in this step's batch, in batch order
    num_tokens: list[int]  # tokens scheduled for each (same order)
    block_copies: list[tuple[int, int]]  # (src, dst) copy-on-write copies to do before the forward
    preempted: list[Request] = field(default_factory=list)  # requests preempted while scheduling
    failed: list[Request] = field(default_factory=list)  # requests that can never run
    num_steps: int = 1  # > 1: every request is one greedy decode row, run for this many steps in one go
    # (each step's argmax the next input; num_tokens[i] == num_steps slots each)
    kv_moves: Moves | None = None  # copies between T0 and the KV tiers below, to apply first (engine.kv_tiers)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


BACKFILL_TRIES = 32  # calls behind the head that may fail to fit in one step before the line stops (a long line
# would otherwise be scanned, prefix lookups and all, at every step)
HEADROOM_FIT = 64  # better-ranked admissions the headroom is fitted from (the latest)
HEADROOM_MIN = 8  # no headroom before this many were seen


class _PromptShare:
    """One step's prompt share (a policy that `yields_prefill`, while calls wait for KV blocks): the prompt chunks of
    the calls that yield to a better call of the step (`policy.yields_to`: one decoding ahead of them in the step, or
    one of the best waiting calls) compute `policy.prefill_yield()` tokens at most, all together. Rows are placed
    in the step's order."""

    __slots__ = ("policy", "waiting", "decoders", "left")

    def __init__(self, policy: SchedulingPolicy, waiting: list[Request]) -> None:
        self.policy, self.waiting = policy, waiting[:4]  # the best waiting calls (sorted)
        self.decoders: list[Request] = []  # decode rows placed so far
        self.left = policy.prefill_yield()

    def yields(self, req: Request, waiting: bool = False) -> bool:
        yields_to = self.policy.yields_to
        if any(yields_to(req, d) for d in self.decoders):
            return True
        return waiting and any(yields_to(req, w) for w in self.waiting)

    def cap(self, n: int) -> int:
        """A yielding chunk's tokens (`n` before the share), taken from what is left."""
        n = max(0, min(n, self.left))
        self.left -= n
        return n

    def place(self, req: Request, n: int, prompt: bool) -> int:
        """A running row's tokens this step (`n` before the share)."""
        if not prompt:
            self.decoders.append(req)
            return n
        return self.cap(n) if self.yields(req, waiting=True) else n


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        policy: SchedulingPolicy,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.kv = kv
        self.policy = policy
        self.clock = clock
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._classes = False  # this step: some request is in a class other than 0
        self._seats = config.max_num_seqs  # this step: the running set's size limit (policy.max_running)
        self._better_needs: collections.deque[int] = collections.deque(maxlen=HEADROOM_FIT)  # blocks better-ranked
        # calls needed at admission (policy.keeps_headroom), and the headroom fitted from them (refitted per admission)
        self._headroom = 0
        self._blocks_short = False  # the latest step: a call waited for KV blocks, or one was preempted for them

    # ---- queue management ----------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self.policy.on_arrival(req, self.clock())
        self.kv.prefetch(req)  # its prefix's disk blocks read ahead while it waits (KV tiers)

    def add_forked(self, parent: Request, child: Request) -> None:
        """`child` joins the running batch sharing all of `parent`'s blocks."""
        self.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        child.first_scheduled_time = parent.first_scheduled_time
        self.running.append(child)
        self.policy.on_arrival(child, self.clock())

    @property
    def seats(self) -> int:
        """The latest step's running-set limit: max_num_seqs, or the policy's cap (`max_running`)."""
        return self._seats

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus, reason: str | None = None) -> None:
        """End a request (any reason) and give back its blocks."""
        if req.finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.finish_time = self.clock()
        done = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)  # not aborted or failed
        self.kv.free(req, req.finish_time, retain=done)
        req.status = status
        req.finish_reason = reason or status.value
        self.policy.on_finish(req, req.finish_time)

    def expire_pins(self) -> float:
        """Drop expired pins (unless their program waits); the next pin deadline (inf: none)."""
        return self.kv.expire_pins(self.clock(), {r.program_id for r in self.waiting})

    def program_op(self, op: ProgramOp) -> None:
        """A program operation (engine.program_ops), between steps, on this scheduler's clock."""
        self.kv.program_op(op, self.clock())
        if isinstance(op, EndProgram):
            self.policy.end_program(op.program_id)

    # ---- priority classes over the policy (self._classes: some request is not in class 0; else the
    # policy's own keys, at no cost) ----------------------------------------------------------------
    def _key(self, req: Request) -> tuple[int, object]:
        return (req.sampling.priority, self.policy.priority(req))

    def _pick_victim(self, candidates: list[Request]) -> Request:
        """The policy's victim among the requests of the largest class."""
        if self._classes:
            worst = max(r.sampling.priority for r in candidates)
            candidates = [r for r in candidates if r.sampling.priority == worst]
        return self.policy.pick_victim(candidates)

    def _displaces(self, waiting: Request, running: Request, for_seat: bool = False) -> bool:
        a, b = waiting.sampling.priority, running.sampling.priority
        if a != b:
            return a < b
        return (self.policy.preemptive or for_seat) and self.policy.displaces(waiting, running)

    def _class_waits(self) -> bool:
        """A waiting request of a smaller class than some running one."""
        return self._classes and bool(self.waiting and self.running) and (
            min(r.sampling.priority for r in self.waiting) < max(r.sampling.priority for r in self.running))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req, retain=False)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)
        out.preempted.append(req)
        self.policy.on_preempt(req, self.clock())

    # ---- the step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        self.expire_pins()
        self.policy.before_schedule(self.waiting, self.running, now)
        cap = self.policy.max_running(self.waiting, self.running, self.config.max_num_seqs)
        self._seats = self.config.max_num_seqs if cap is None else max(1, min(cap, self.config.max_num_seqs))
        self._classes = any(r.sampling.priority for r in self.running) or any(r.sampling.priority for r in self.waiting)
        self.running.sort(key=self._key if self._classes else self.policy.priority)
        self.waiting.sort(key=self._waiting_key())
        out = SchedulerOutput(reqs=[], num_tokens=[], block_copies=[])
        if self.policy.preemptive or self._class_waits():
            self._displace_for_better_waiting(out)
        elif self.policy.displaces_for_seats and self.waiting and len(self.running) >= self._seats:
            self._displace_for_better_waiting(out, seats_only=True)
        budget = self.config.max_num_batched_tokens
        out.num_steps = steps = self._multi_steps(budget)
        scheduled: set[int] = set()
        short_of_blocks = False  # after a preemption for blocks, admit nobody this step
        share = _PromptShare(self.policy, self.waiting) if (
            self.policy.yields_prefill and self._blocks_short and steps == 1 and self.running) else None
        self._blocks_short = False  # (prompts that yield: while calls wait for blocks, `yields_prefill`)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            base = req.num_tokens - req.num_computed_tokens
            n = steps if steps > 1 else min(base + len(req.spec_token_ids), budget)
            if share is not None:
                n = share.place(req, min(n, base) if base > 1 else n, base > 1)
            del req.spec_token_ids[max(0, n - base) :]  # drafts that do not fit the budget
            if n <= 0:  # nothing to compute this step; keep its blocks and its place
                scheduled.add(id(req))
                i += 1
                continue
            while not self.kv.allocate_slots(req, n, may_take_reserved=True):
                if steps == 1 and n > 1 and self.kv.windowed:  # a window group holds the chunk's every block
                    n //= 2
                    del req.spec_token_ids[max(0, n - base) :]
                    continue
                victims = [r for r in self.running if id(r) not in scheduled and r is not req]
                victim = self._pick_victim(victims) if victims else req
                self._preempt(victim, out)
                short_of_blocks = self._blocks_short = True
                if victim is req:
                    break
            else:
                scheduled.add(id(req))
                out.reqs.append(req)
                out.num_tokens.append(n)
                budget -= n
                i += 1

        protect_pins = self.policy.protect_pins
        in_flight: set[bytes] | None = None  # hashes of the full blocks this step computes (made on first need)
        j = 0  # waiting requests before j wait for blocks this step computes
        headroom_blocked = False  # a call that leaves headroom waits for it this step (policy.keeps_headroom)
        blocked: Request | None = None  # the best waiting call that did not fit this step (policy.backfill_s)
        misses = 0  # calls that did not fit behind it
        while (not short_of_blocks and j < len(self.waiting) and budget > 0
               and len(self.running) < self._seats):
            req = self.waiting[j]
            error = self.kv.capacity_error(req)
            if error is not None:  # would preempt itself forever
                self.waiting.pop(j)
                out.failed.append(req)
                req.error = error
                self.finish(req, RequestStatus.FINISHED_ERROR, "error")
                continue
            idle = not self.running  # nobody would free blocks: reservations must give way
            take_pins = self._may_take_pins(req, idle, protect_pins)
            hits, num_hit = self.kv.get_computed_blocks(req, may_take_pinned=take_pins)
            next_hash = self.kv.next_block_hash(req, len(hits))
            if next_hash is not None:
                if in_flight is None:
                    in_flight = self._computed_this_step(out)
                if next_hash in in_flight:
                    # its next block is being computed by a request of this step: waiting a step finds it
                    # in the prefix cache, instead of computing the same prefix twice (in-batch prefix sharing)
                    j += 1
                    continue
            n = min(req.num_tokens - num_hit, budget)
            yielding = share is not None and n > 1 and share.yields(req)  # its chunk takes from the step's share
            if yielding:
                n = min(n, share.left)
                if n <= 0:  # the share of this step for prompts that yield is spent (blocks untried: still short)
                    self._blocks_short = True
                    j += 1
                    continue
            need = None
            if self.policy.keeps_headroom and not idle:
                if self.policy.leaves_headroom(req):
                    room = self.headroom_blocks()
                    if headroom_blocked or (room and not self.kv.fits_whole(req, hits, take_pins,
                                                                            self.policy.admit_output_tokens, room)):
                        headroom_blocked = True  # it waits, and so do the calls behind it that leave headroom
                        j += 1  # (FCFS among them); a better call behind it may still go in
                        continue
                elif req.first_scheduled_time is None:
                    need = self.kv.blocks_needed(req, hits, self.policy.admit_output_tokens)
            while not (fits := self.kv.allocate_slots(req, n, hits, may_take_reserved=idle, may_take_pinned=take_pins,
                                                      whole=protect_pins and not idle,
                                                      whole_output=self.policy.admit_output_tokens)):
                if not (idle and n > 1 and self.kv.windowed):
                    break
                n //= 2  # alone, with a window group holding a chunk's every block: a smaller first chunk
            if not fits:
                self._blocks_short = True
                if blocked is None:
                    blocked = req
                    if not self._backfills(req, now):
                        break  # head of line waits for blocks (FCFS fairness; the policy chose the order)
                misses += 1
                if misses > BACKFILL_TRIES:
                    break
                j += 1  # backfill: a call behind the head may fit
                continue
            self.waiting.pop(j)
            if need is not None:
                self._fit_headroom(need)
            if req.num_preemptions:
                req.num_recomputed_tokens += n
            elif req.first_scheduled_time is None:
                req.num_prefix_hit_tokens = num_hit
                self.kv.admitted(req, num_hit)
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.running.append(req)
            out.reqs.append(req)
            out.num_tokens.append(n)
            budget -= n
            if yielding and n > 1:
                share.cap(n)
            if in_flight is not None:
                in_flight.update(self.kv.hashes_completed(req, n))
        out.block_copies = self.kv.take_pending_copies()
        out.kv_moves = self.kv.take_tier_moves()
        return out

    def _backfills(self, head: Request, now: float) -> bool:
        """May calls behind `head` (the best waiting call, which does not fit) go in this step? While it has waited
        for less than the policy's `backfill_s` (see the module docstring)."""
        limit = self.policy.backfill_s
        return limit is not None and now - head.arrival_time < limit

    def headroom_blocks(self) -> int:
        """The blocks a call that `leaves_headroom` must leave free (see the module docstring); 0 until fitted."""
        return self._headroom

    def _fit_headroom(self, need: int) -> None:
        needs = self._better_needs
        needs.append(need)
        if len(needs) >= HEADROOM_MIN:
            self._headroom = min(sorted(needs)[(len(needs) * 9) // 10], self.kv.num_blocks // 2)

    def _may_take_pins(self, req: Request, idle: bool, protect_pins: bool) -> bool | Callable[[str], bool]:
        """Whose pins may give way to a waiting request: everyone's (an idle engine, or no admission control);
        under `protect_pins` nobody's unless its own program holds a pin (it resumes from a tool call), and then
        everyone's, or with `pins_by_rank` those of the programs the policy says it outranks (with `new_take_pins`
        also for a program holding no pin)."""
        if idle or not protect_pins:
            return True
        if not self.kv.holds_pin(req.program_id) and not (self.policy.pins_by_rank and self.policy.new_take_pins):
            return False
        if self.policy.pins_by_rank:
            outranks = self.policy.outranks
            return lambda program_id: outranks(req, program_id)
        return True

    def _computed_this_step(self, out: SchedulerOutput) -> set[bytes]:
        hashes: set[bytes] = set()
        if out.num_steps == 1:  # a multi-step decode completes blocks of tokens not known yet
            for req, n in zip(out.reqs, out.num_tokens):
                hashes.update(self.kv.hashes_completed(req, n))
        return hashes

    def _multi_steps(self, budget: int) -> int:
        """Decode steps to run in one go (config.num_scheduler_steps, vLLM's multi-step scheduling): more
        than one only when nobody waits and every running request is a plain greedy decode row; as
        many as the token budget, each request's max_tokens and its context allow, and only when the
        blocks for all of them are free without taking others' reservations or pins (allocated here;
        where they are not, the blocks already taken serve the next steps)."""
        k = self.config.num_scheduler_steps
        if k <= 1 or self.waiting or not self.running:
            return 1
        k = min(k, budget // len(self.running))
        for req in self.running:
            if (req.num_tokens - req.num_computed_tokens != 1 or req.spec_token_ids or req.constrained
                    or not req.sampling.plain_greedy):
                return 1
            k = min(k, req.sampling.max_tokens - req.num_output_tokens, req.max_model_len - req.num_tokens)
        if k <= 1:
            return 1
        for req in self.running:
            if not self.kv.allocate_slots(req, k, may_take_reserved=False, may_take_pinned=False):
                return 1
        return k

    def _waiting_key(self) -> Callable[[Request], object]:
        """The order of the waiting queue: by class, then the policy's order, with `pinned_first` calls
        of programs holding a pin ahead of the rest of their class, except while the policy caps the running
        set: seats, not KV, are short then, and they go in the policy's order."""
        if not self.policy.pinned_first or self._seats < self.config.max_num_seqs:
            return self._key if self._classes else self.policy.priority
        holds_pin, key = self.kv.holds_pin, self.policy.pinned_key
        if not self._classes:
            return lambda r: key(r, holds_pin(r.program_id))
        return lambda r: (r.sampling.priority, key(r, holds_pin(r.program_id)))

    def _displace_for_better_waiting(self, out: SchedulerOutput, seats_only: bool = False) -> None:
        """A waiting request that ranks above the worst running one (by class; within a class only
        under a preemptive policy) takes its place when there is no seat or no blocks for it. `seats_only`
        (a policy that `displaces_for_seats` without being preemptive): only for a seat of a capped running
        set, the victim the worst-ranked running request (not the policy's victim for blocks)."""
        key = self._waiting_key()
        max_seqs, max_tokens = self._seats, self.config.max_num_batched_tokens
        allocatable: dict[str | None, int] = {}  # per owner, until the next preemption changes it
        per_owner = self.kv.num_reserved_blocks > 0  # without reservations every owner may take the same
        seated = 0  # better waiting requests already given a free seat (admission fills them in this order)
        for w in list(self.waiting):
            if not self.running:
                return
            need = self.kv.blocks_for(min(w.num_tokens, max_tokens))
            while self.running:
                if len(self.running) + seated < max_seqs:
                    if seats_only:
                        seated += 1
                        break
                    owner = w.program_id if per_owner else None
                    room = allocatable.get(owner)
                    if room is None:
                        room = allocatable[owner] = self.kv.num_allocatable(w.program_id)
                    if need <= room:
                        seated += 1
                        break
                worst = max(self.running, key=self._key) if seats_only else self._pick_victim(self.running)
                if not self._displaces(w, worst, seats_only):
                    return
                self._preempt(worst, out)
                allocatable.clear()
        self.waiting.sort(key=key)

    def update_from_output(self, out: SchedulerOutput, step_time_s: float, num_rejected: list[int] | None = None) -> None:
        """Advance computed counts (less rejected draft tokens), register full blocks, attribute
        executor time (rejected drafts included: they were computed)."""
        total = out.total_tokens or 1
        service = [step_time_s * n / total for n in out.num_tokens]
        rejected = num_rejected or [0] * len(out.reqs)
        for req, n, s, r in zip(out.reqs, out.num_tokens, service, rejected):
            req.num_computed_tokens += n - r
            req.spec_token_ids = []
            req.service_s += s
            self.kv.cache_blocks(req)
        self.policy.on_step(out.reqs, service, out.num_tokens, self.clock())
