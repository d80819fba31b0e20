"""The simulator's engine: the engine's own `Scheduler` and `KVCacheManager` on a virtual clock, with the
forward pass replaced by a step-cost model (`agentrt/bench/costs.py`) and sampling by a seeded RNG.

Decode runs: most steps of a lightly loaded engine only decode (every running call computes its one new
token, nobody waits). While nothing can change but the counters, `step` runs such steps without the
parts of `Scheduler.schedule` that would find nothing to do, and with exactly the same effects, in the
same order, as single steps (tests/agentrt/test_simulate.py checks equality with `fast=False`). A step
is a plain decode step when, before it:
- nothing waits (no admission, no displacement) and every running call has computed all but its last
  token (one token each) and has no draft tokens, and they all fit the token budget;
- no call's new token needs a new block or fills one (no allocation, copy-on-write or block to cache);
- no call reaches its `max_tokens` (no finish: the last step of a call is a normal one);
- no pin is due (no expiry) and no timer of the simulation is due (no arrival, no tool return).
The policy's hooks (`before_schedule`, the running order, `on_step`) and the service attribution run
as in every step.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

from agentrt.bench import workload as wl
from agentrt.bench.costs import StepCost
from agentrt.bench.sim_tiers import TierCost, apply_moves, make_tiers
from agentrt.bench.workload import Call
from agentrt.engine.config import EngineConfig
from agentrt.engine.kv_cache_manager import KVCacheManager
from agentrt.engine.policy import SchedulingPolicy
from agentrt.engine.program_ops import ProgramOp
from agentrt.engine.request import Request, RequestStatus
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.scheduler import Scheduler, SchedulerOutput


class SimEngine:
    """The engine's scheduler and KV-cache manager on a virtual clock; the model is `cost`."""

    def __init__(self, policy: SchedulingPolicy, *, max_num_seqs: int, max_num_batched_tokens: int,
                 num_blocks: int = 4096, block_size: int = 16, cost: StepCost | None = None, seed: int = 0,
                 fast: bool = True, tiers: TierCost | None = None):
        self.now = 0.0
        self.cost = cost or StepCost()
        config = EngineConfig(device="cpu", max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              num_blocks=num_blocks, block_size=block_size, policy=policy)
        # the KV tiers below the cache (agentrt/bench/sim_tiers.py): the engine's tier code, loads timed by bandwidth
        self.tier_cost = tiers
        self.tiers = make_tiers(tiers, block_size, self.cost.token_s, num_blocks) if tiers is not None else None
        self.kv = KVCacheManager(num_blocks, block_size, True, tiers=self.tiers)
        self.pinned_block_s = 0.0  # pinned blocks integrated over virtual time
        self.scheduler = Scheduler(config, self.kv, policy, clock=lambda: self.now)
        self.policy = policy
        self.rng = random.Random(seed)
        self.fast = fast  # run plain decode steps on the fast path (module docstring)
        self.busy_s = 0.0
        self.num_steps = 0
        self.num_fast_steps = 0
        self.num_computed_tokens = 0
        self._done: dict[str, Callable[[list[int]], None]] = {}
        self._ids = itertools.count()

    def program_op(self, op: ProgramOp) -> None:
        self.scheduler.program_op(op)

    def add(self, call: Call, program_id: str, thread_id: str, on_done: Callable[[Request], None],
            arrival: float | None = None) -> None:
        """A call submitted at `arrival` (default: now); one that arrived during the last step (`arrival` before
        now) reaches the scheduler only now, as a real engine's does, and has waited since its arrival."""
        rid = f"sim-{next(self._ids)}"
        req = Request(rid, list(call.prompt), SamplingParams(max_tokens=call.max_tokens, ignore_eos=True),
                      program_id=program_id, thread_id=thread_id, arrival_time=self.now if arrival is None else arrival)
        self._done[rid] = on_done
        self.scheduler.add_request(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self, until: float = math.inf) -> None:
        """One step, or a run of plain decode steps while the clock is before `until` (the next timer)."""
        runs = self._decode_run_length() if self.fast else 0
        if runs:
            self._decode_steps(runs, until)
            return
        out = self.scheduler.schedule()
        if out.failed:
            raise RuntimeError(f"simulated request failed: {out.failed[0].error}")
        dt = self.cost(out, self.kv.block_size)
        if self.tiers is not None:
            dt += apply_moves(self.tiers, out.kv_moves, self.tier_cost)
        self.pinned_block_s += self.kv.num_pinned_blocks * dt
        self.now += dt
        self.busy_s += dt
        self.num_steps += 1
        self.num_computed_tokens += out.total_tokens
        self.scheduler.update_from_output(out, dt)
        for req in out.reqs:
            if req.finished or req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk short of the end samples nothing
            req.append_token(self.rng.randrange(*wl.VOCAB))
            if req.num_output_tokens >= req.sampling.max_tokens:
                self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH, "length")
                self._done.pop(req.request_id)(req)

    def _decode_run_length(self) -> int:
        """How many plain decode steps may run from here, timers and pins aside (0: take a normal step)."""
        sch = self.scheduler
        running = sch.running
        if sch.waiting or not running or len(running) > sch.config.max_num_batched_tokens:
            return 0
        bs, ref_cnt = self.kv.block_size, self.kv.pool.ref_cnt
        k = math.inf
        for r in running:
            c = r.num_computed_tokens
            if c != r.num_tokens - 1 or r.spec_token_ids or r.children or r.num_cached_blocks != c // bs:
                return 0
            if c + 1 > len(r.block_ids) * bs or ref_cnt[r.block_ids[c // bs]] != 1:
                return 0  # needs a block now, or writes into a shared one
            # steps before one fills a block (-(c + 1) % bs) or finishes (the finishing step is a normal one)
            k = min(k, -(c + 1) % bs, r.sampling.max_tokens - r.num_output_tokens - 1)
            if k <= 0:
                return 0
        return int(k)

    def _decode_steps(self, runs: int, until: float) -> None:
        """`runs` plain decode steps (at least one), stopping early at `until` or a pin deadline: the
        effects of `Scheduler.schedule` + `update_from_output` on such a step, in the same order."""
        sch, policy, kv = self.scheduler, self.policy, self.kv
        key = policy.priority
        sch.expire_pins()  # as the first step's schedule() would; no pin is due before `stop`
        stop = min(until, kv.next_pin_deadline())
        pinned = kv.num_pinned_blocks  # no pin is made, dissolved or dropped during plain decode steps
        for i in range(runs):
            if i and self.now >= stop:
                return
            policy.before_schedule(sch.waiting, sch.running, self.now)
            sch.running.sort(key=key)
            reqs = list(sch.running)
            ones = [1] * len(reqs)
            out = SchedulerOutput(reqs=reqs, num_tokens=ones, block_copies=[])
            dt = self.cost(out, self.kv.block_size)
            self.now += dt
            self.busy_s += dt
            self.num_steps += 1
            self.num_fast_steps += 1
            self.pinned_block_s += pinned * dt
            self.num_computed_tokens += len(reqs)
            s = dt * 1 / (len(reqs) or 1)
            for req in reqs:
                req.num_computed_tokens += 1
                req.service_s += s
            policy.on_step(reqs, [s] * len(reqs), ones, self.now)
            for req in reqs:
                req.append_token(self.rng.randrange(*wl.VOCAB))
