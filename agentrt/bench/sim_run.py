"""The simulator's run: a workload's program plans driven to their end on the simulated engine
(`agentrt/bench/sim_engine.py`) in virtual time; the saturation rate (`capacity`) and the engine settings of
full-size agents on a named GPU cost model (`agent_engine`).

The layer below the simulator's commands: `agentrt bench simulate` (agentrt/bench/simulate.py, which reports
in the format of `agentrt bench programs`), the replicas simulator (agentrt/bench/sim_replicas.py) and
`agentrt bench programs --load` (its calibrated saturation) all run workloads through here.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any

from agentrt._retention import RetentionConfig, RetentionPolicy
from agentrt.bench import costs
from agentrt.bench import workload as wl
from agentrt.bench.costs import StepCost
from agentrt.bench.sim_engine import SimEngine
from agentrt.bench.sim_tiers import TierCost, cpu_host
from agentrt.bench.workload import Parallel, ProgramSpec, Tool
from agentrt.engine.policy import SchedulingPolicy, make_policy
from agentrt.engine.program_ops import EndProgram
from agentrt.engine.request import Request

DEFAULT_ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 256}  # the engine settings of a run that names none


def capacity(workload: list[ProgramSpec], *, engine: dict[str, Any] | None = None, cost: StepCost | None = None) -> float:
    """Programs per second the engine completes when the whole workload arrives at once (FCFS): the
    arrival rate at which it saturates."""
    burst = [ProgramSpec(s.index, s.kind, 0.0, s.seed) for s in workload]
    return len(burst) / simulate("fcfs", burst, engine=engine, cost=cost)["makespan_s"]


def served_knee(workload: list[ProgramSpec], *, engine: dict[str, Any] | None = None, cost: StepCost | None = None,
                levels: tuple[int, ...] = (4, 8, 16, 32, 64), settle: float = 0.25, **kwargs: Any) -> dict[str, Any]:
    """The simulator's saturation measured as `agentrt bench programs --http` measures the server's
    (agentrt/bench/programs_http.py `measure_saturation`): the workload's programs kept N in flight (a closed loop),
    for N in `levels` until one gives less output than the best so far; each level's output tokens a second over
    its steady spell, from the time the first `settle` of its programs have ended to the last program's start
    (after which fewer than N are in flight). Returns {"curve": {N: tok/s}, "in_flight": best N, "output_tok_s"}.
    `kwargs` go to `simulate` (`like_http()`)."""
    curve: dict[int, float] = {}
    for n in levels:
        done = simulate("fcfs", workload, engine=engine, cost=cost, in_flight=n, **kwargs)["programs"]
        t1 = max(p["start_s"] for p in done)
        t0 = sorted(p["end_s"] for p in done)[int(settle * len(done))]
        spell = [p for p in done if t0 < p["end_s"] <= t1]
        if t1 <= t0 or len(spell) < 2 * n:
            raise ValueError(f"served_knee: {len(workload)} programs leave no steady spell at {n} in flight")
        curve[n] = sum(p["output_tokens"] for p in spell) / (t1 - t0)
        if curve[n] < max(curve.values()):
            break
    best = max(curve, key=curve.__getitem__)
    return {"curve": curve, "in_flight": best, "output_tok_s": curve[best]}


def like_http() -> dict[str, Any]:
    """`simulate`'s arguments for programs served as `agentrt bench programs --http` serves them: TTL pins as the
    server keeps them, and no program ever said to end (an OpenAI client just stops calling)."""
    return {"retention": RetentionConfig(), "end_programs": False}


def simulate(policy: str | SchedulingPolicy, workload: list[ProgramSpec], *, policy_kwargs: dict[str, Any] | None = None,
             engine: dict[str, Any] | None = None, cost: StepCost | None = None,
             retention: RetentionConfig | None = None, tiers: TierCost | None = None,
             end_programs: bool = True, in_flight: int | None = None) -> dict[str, Any]:
    """Run the workload's plans to completion; per-program latencies and engine counters (virtual seconds).
    `retention`: run agentrt's retention policy (TTL pins, reservations) over the engine's own pin code.
    `tiers`: KV tiers below the cache (agentrt/bench/sim_tiers.py); the retention TTL then weighs their reload cost.
    An `engine` with `kv_host_gib` (a real engine's argument) simulates a CPU engine's host tier (`cpu_host`).
    `end_programs=False`: a program's end is never told to the engine, as with a client of the HTTP API (an OpenAI
    SDK), whose programs just stop calling (`agentrt bench programs --http`).
    `in_flight=N`: a closed loop instead of the arrival times: N programs start at once and each that ends starts the
    next of the workload, in order (`served_knee`); each program's start is then its `start_s` in the results."""
    if in_flight is not None and in_flight < 1:
        raise ValueError(f"in_flight must be a program count >= 1, got {in_flight!r}")
    pol = make_policy(policy, **(policy_kwargs or {}))
    engine = {**DEFAULT_ENGINE, **(engine or {})}
    if host_gib := engine.pop("kv_host_gib", 0):
        if tiers is not None:
            raise ValueError("simulate: give tiers or an engine's kv_host_gib, not both")
        tiers = cpu_host(host_gib)
    eng = SimEngine(pol, **engine, cost=cost, tiers=tiers)
    ret = None
    if retention is not None:
        reload = eng.tiers.reload_s_per_token() if eng.tiers is not None else None
        ret = RetentionPolicy(retention, eng.program_op, eng.kv.num_blocks * eng.kv.block_size, reload_s_per_token=reload)
    timers: list[tuple[float, int, Callable[[], None]]] = []
    seq = itertools.count()
    results: list[dict[str, Any] | None] = [None] * len(workload)
    pending = iter(workload[in_flight:] if in_flight is not None else ())

    # A timer that fell due during a step (an arrival, a tool's return) runs after that step, as a real engine
    # schedules a call that arrives mid-step only at its next step; but the call was submitted when the timer fell
    # due: its request's arrival time and the gap retention learns (the tool's time) are that time, not the step's end.
    due: float | None = None

    def submitted() -> float:
        return eng.now if due is None else due

    def at(t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(timers, (t, next(seq), fn))

    def start(spec: ProgramSpec) -> None:
        pid, gen, started = f"prog-{spec.index}", wl.plan(spec), submitted()
        stats = {"calls": 0, "output_tokens": 0, "queue_s": 0.0, "run_s": 0.0, "preemptions": 0, "recomputed_tokens": 0}
        if ret is not None:
            ret.program_started(pid, None)

        def advance(value: Any) -> None:
            try:
                action = gen.send(value)
            except StopIteration:
                if end_programs and ret is not None:
                    ret.program_ended(pid)
                elif end_programs:
                    eng.program_op(EndProgram(pid))
                arrived = started if in_flight is not None else spec.arrival_s
                results[spec.index] = {"kind": spec.kind, "start_s": started, "end_s": eng.now,
                                       "latency_s": eng.now - arrived, **stats}
                if (nxt := next(pending, None)) is not None:
                    start(nxt)
                return
            if isinstance(action, Tool):
                if ret is not None:
                    ret.tool_started(pid, spec.kind, None)
                at(eng.now + action.seconds, lambda: advance(action.observation))
                return
            calls = action.calls if isinstance(action, Parallel) else (action,)
            outs: list[list[int] | None] = [None] * len(calls)

            def done(i: int, req: Request) -> None:
                outs[i] = ids = list(req.output_token_ids)
                stats["calls"] += 1
                stats["output_tokens"] += len(ids)
                first = req.first_scheduled_time if req.first_scheduled_time is not None else eng.now
                stats["queue_s"] += first - req.arrival_time  # waiting for a seat or blocks, behind the order
                stats["run_s"] += eng.now - first  # first step to the end: steps, preempted spells, recompute
                stats["preemptions"] += req.num_preemptions
                stats["recomputed_tokens"] += req.num_recomputed_tokens
                if ret is not None:
                    wait = (req.first_scheduled_time or eng.now) - req.arrival_time
                    ret.call_ended(pid, eng.now, tokens=req.num_tokens, computed_tokens=req.num_tokens,
                                   service_s=req.service_s, wait_s=wait)
                if all(o is not None for o in outs):
                    advance(outs if isinstance(action, Parallel) else outs[0])

            if ret is not None:
                ret.call_submitted(pid, submitted())
            for i, call in enumerate(calls):
                eng.add(call, pid, f"{pid}.t{i}", lambda req, i=i: done(i, req), arrival=submitted())

        advance(None)

    if in_flight is None:
        for spec in workload:
            at(spec.arrival_s, lambda spec=spec: start(spec))
    else:
        for spec in workload[:in_flight]:
            at(0.0, lambda spec=spec: start(spec))
    while timers or eng.has_work():
        while timers and timers[0][0] <= eng.now:
            due, _, fn = heapq.heappop(timers)
            fn()
            due = None
        if eng.has_work():
            eng.step(timers[0][0] if timers else math.inf)  # what arrives during a step is added after it
        elif timers:
            eng.now = max(eng.now, timers[0][0])
    makespan = eng.now
    if not end_programs:  # what the server's idle timeout does after the run: pins and state released
        for spec in workload:
            eng.program_op(EndProgram(f"prog-{spec.index}"))
    assert eng.kv.num_free_blocks == eng.kv.num_blocks, "simulation leaked KV blocks"
    done = [r for r in results if r is not None]
    assert len(done) == len(workload), "a program never finished"
    return {
        "policy": getattr(pol, "name", str(policy)),
        "makespan_s": makespan,
        "utilization": eng.busy_s / makespan if makespan else 0.0,
        "steps": eng.num_steps,
        "computed_tokens": eng.num_computed_tokens,
        "preemptions": eng.scheduler.num_preemptions,
        "prefix_hit_rate": eng.kv.stats.hit_tokens / max(1, eng.kv.stats.queries_tokens),
        "recomputed_prefill_tokens": eng.kv.retention.recomputed_prefill_tokens,
        "ttl_hits": eng.kv.retention.ttl_hits,
        "ttl_misses": eng.kv.retention.ttl_misses,
        "pinned_block_s": eng.pinned_block_s,
        "tier_hits": {name: st.hits for name, st in (eng.tiers.stats() if eng.tiers is not None else {}).items()},
        "programs": done,
    }


def agent_engine(cost_model: str, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int) -> tuple[StepCost, dict[str, Any]]:
    """The step cost and engine settings of full-size agents on a named GPU cost model: its KV cache in
    blocks of `block_size` tokens."""
    cost, kv_tokens, _ = costs.named(cost_model)
    if kv_tokens is None:
        raise SystemExit(f"cost model {cost_model!r} has no KV-cache size: choose a GPU model for full-size agents")
    return cost, {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                  "num_blocks": kv_tokens // block_size, "block_size": block_size}
