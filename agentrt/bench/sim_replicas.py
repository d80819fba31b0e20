"""Replicas in the simulator: N simulated engines (agentrt/bench/sim_engine.py, each the engine's own scheduler and
KV-cache manager on a virtual clock) behind a router, the program router being the very function the Ray
router runs (agentrt.scale.router.route).

    simulate_replicas(workload, replicas=4, router="program", cost=cost)

Routers: "program" (agentrt.scale.router: a program's calls follow it, the load guard), "least-loaded"
(every call to the replica with the fewest calls waiting or running), "pow2" (two replicas at random, the
less loaded: Ray's default), "round-robin", and "prefix", a stand-in for Ray's PrefixCacheAffinityRouter
(its documented rule, over token blocks instead of characters: when the replicas' loads differ by less
than `imbalance` calls, the replica whose routed prompts share the longest prefix with this one, if that
covers at least 10% of it, else the one holding the fewest routed blocks; otherwise pow2). Ray's own
router classes need a Ray cluster, so the simulator runs these rules, not Ray's code.

Each engine has its own clock; the loop always steps the engine furthest behind, and runs a timer (a
program's arrival, a tool's end) once every busy engine has reached its time. A call routed to an idle
engine starts at the router's time; one routed to a busy engine whose clock is behind joins its queue
(arriving, on its clock, up to one step early).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from typing import Any

import agentrt.policies  # noqa: F401  (registers plas / atlas / mlfq)
from agentrt.bench import workload as wl
from agentrt.bench.costs import StepCost
from agentrt.bench.sim_engine import SimEngine
from agentrt.bench.workload import Parallel, ProgramSpec, Tool
from agentrt.engine.policy import make_policy
from agentrt.engine.program_ops import EndProgram
from agentrt.engine.request import Request
from agentrt.scale.router import ProgramHomes, RouterConfig

SIM_ROUTERS = ("program", "least-loaded", "pow2", "round-robin", "prefix")
BLOCK = 16  # tokens per block of the prefix stand-in's tree


class _Router:
    """One routing rule over the engines' loads; `choose` returns the engine index for a call."""

    def __init__(self, name: str, n: int, seed: int, config: RouterConfig, imbalance: int = 10) -> None:
        if name not in SIM_ROUTERS:
            raise ValueError(f"unknown router {name!r}; expected one of {', '.join(SIM_ROUTERS)}")
        self.name, self.n, self.config, self.imbalance = name, n, config, imbalance
        self.rng = random.Random(seed)
        self.homes = ProgramHomes()
        self.rr = itertools.count()
        self.tree: dict[int, set[int]] = {}  # prefix stand-in: hash of a block-aligned prefix -> replicas
        self.held = [0] * n  # prefix stand-in: blocks routed to each replica (its "tenant" size)

    def choose(self, pid: str, prompt: list[int], loads: list[int], now: float = 0.0) -> int:
        if self.name == "program":
            d = self.homes.route(pid, len(prompt), {str(i): load for i, load in enumerate(loads)}, self.config,
                                 key=pid, now=now)
            return int(d.ranked[0][0])
        if self.name == "least-loaded":
            low = min(loads)
            return self.rng.choice([i for i, load in enumerate(loads) if load == low])
        if self.name == "round-robin":
            return next(self.rr) % self.n
        if self.name == "pow2":
            return self._pow2(loads)
        return self._prefix(prompt, loads)

    def _pow2(self, loads: list[int]) -> int:
        a, b = self.rng.sample(range(self.n), 2) if self.n > 1 else (0, 0)
        return a if loads[a] <= loads[b] else b

    def _prefix(self, prompt: list[int], loads: list[int]) -> int:
        keys, h = [], 0
        for k in range(len(prompt) // BLOCK):  # chained, as the engine's block hashes: a key names its whole prefix
            h = hash((h, tuple(prompt[k * BLOCK:(k + 1) * BLOCK])))
            keys.append(h)
        if max(loads) - min(loads) >= self.imbalance:
            choice = self._pow2(loads)
        else:
            best, best_len = None, 0
            for depth in range(len(keys), 0, -1):  # the deepest prefix some replica was sent
                holders = self.tree.get(keys[depth - 1])
                if holders:
                    best, best_len = min(holders, key=lambda i: loads[i]), depth
                    break
            if best is not None and best_len * BLOCK >= 0.1 * len(prompt):
                choice = best
            else:
                choice = min(range(self.n), key=lambda i: (self.held[i], loads[i]))
        for key in keys:
            holders = self.tree.setdefault(key, set())
            if choice not in holders:
                holders.add(choice)
                self.held[choice] += 1
        return choice


def simulate_replicas(workload: list[ProgramSpec], *, replicas: int, router: str, policy: str = "plas",
                      engine: dict[str, Any] | None = None, cost: StepCost | None = None, seed: int = 0,
                      router_config: RouterConfig | None = None) -> dict[str, Any]:
    """Run the workload over `replicas` simulated engines behind `router`; per-program latencies (virtual
    seconds), prefix hit rate, calls per replica."""
    from agentrt.bench.sim_run import DEFAULT_ENGINE

    engines = [SimEngine(make_policy(policy), **{**DEFAULT_ENGINE, **(engine or {})}, cost=cost, seed=seed + i)
               for i in range(replicas)]
    chooser = _Router(router, replicas, seed, router_config or RouterConfig())
    timers: list[tuple[float, int, Callable[[], None]]] = []
    seq = itertools.count()
    results: list[dict[str, Any] | None] = [None] * len(workload)
    calls_on = [0] * replicas
    used: dict[str, set[int]] = {}
    clock = [0.0]  # the router's time: the timer or completion being handled

    def at(t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(timers, (t, next(seq), fn))

    def load(e: SimEngine) -> int:
        return len(e.scheduler.waiting) + len(e.scheduler.running)

    def start(spec: ProgramSpec) -> None:
        pid, gen = f"prog-{spec.index}", wl.plan(spec)
        stats = {"calls": 0, "output_tokens": 0}

        def advance(value: Any) -> None:
            try:
                action = gen.send(value)
            except StopIteration:
                for i in used.pop(pid, ()):
                    engines[i].program_op(EndProgram(pid))
                chooser.homes.forget(pid)  # it ended: no longer live anywhere
                results[spec.index] = {"kind": spec.kind, "latency_s": clock[0] - spec.arrival_s, **stats}
                return
            if isinstance(action, Tool):
                at(clock[0] + action.seconds, lambda: advance(action.observation))
                return
            calls = action.calls if isinstance(action, Parallel) else (action,)
            outs: list[list[int] | None] = [None] * len(calls)

            def done(i: int, eng: SimEngine, req: Request) -> None:
                clock[0] = eng.now
                outs[i] = ids = list(req.output_token_ids)
                chooser.homes.call_done(pid, clock[0])
                stats["calls"] += 1
                stats["output_tokens"] += len(ids)
                if all(o is not None for o in outs):
                    advance(outs if isinstance(action, Parallel) else outs[0])

            for i, call in enumerate(calls):
                k = chooser.choose(pid, call.prompt, [load(e) for e in engines], clock[0])
                chooser.homes.call_started(pid, clock[0])
                eng = engines[k]
                calls_on[k] += 1
                used.setdefault(pid, set()).add(k)
                if not eng.has_work():
                    eng.now = max(eng.now, clock[0])
                eng.add(call, pid, f"{pid}.t{i}", lambda req, i=i, eng=eng: done(i, eng, req))

        advance(None)

    for spec in workload:
        at(spec.arrival_s, lambda spec=spec: start(spec))
    while True:
        busy = [e for e in engines if e.has_work()]
        behind = min(busy, key=lambda e: e.now) if busy else None
        if timers and (behind is None or timers[0][0] <= behind.now):
            t, _, fn = heapq.heappop(timers)
            clock[0] = t
            fn()
        elif behind is not None:
            behind.step(timers[0][0] if timers else math.inf)
        else:
            break
    for e in engines:
        assert e.kv.num_free_blocks == e.kv.num_blocks, "simulation leaked KV blocks"
    done = [r for r in results if r is not None]
    assert len(done) == len(workload), "a program never finished"
    makespan = max(e.now for e in engines)
    hits = sum(e.kv.stats.hit_tokens for e in engines)
    queries = sum(e.kv.stats.queries_tokens for e in engines)
    return {
        "router": router, "replicas": replicas, "makespan_s": makespan, "programs": done,
        "prefix_hit_rate": hits / max(1, queries), "calls_per_replica": calls_on,
        "computed_tokens": sum(e.num_computed_tokens for e in engines),
        "utilization": sum(e.busy_s for e in engines) / (replicas * makespan) if makespan else 0.0,
    }


def replicas_sweep(n: int, rates: list[float], replicas: int, routers: list[str], *, seed: int = 0,
                   policy: str = "plas", block_size: int = 256, cost_model: str = "h100-llama-3.1-8b",
                   max_num_seqs: int = 256, max_num_batched_tokens: int = 8192) -> list[dict[str, Any]]:
    """Full-size agents over `replicas` engines of a named GPU cost model, each router at each total
    arrival rate (agentrt/bench/simulate.py agents_sweep's engine, one per replica)."""
    import time

    from agentrt.bench.sim_run import agent_engine

    cost, engine = agent_engine(cost_model, block_size, max_num_seqs, max_num_batched_tokens)
    rows = []
    for rate in rates:
        work = wl.make_agent_workload(n, rate, seed)
        for router in routers:
            t0 = time.process_time()
            res = simulate_replicas(work, replicas=replicas, router=router, policy=policy, engine=engine, cost=cost,
                                    seed=seed)
            lat = sorted(p["latency_s"] for p in res["programs"])
            rows.append({"config": router, "rate": rate, "replicas": replicas, "programs": n,
                         "latency_mean_s": sum(lat) / len(lat), "latency_p95_s": lat[int(0.95 * (len(lat) - 1))],
                         "latency_p99_s": lat[int(0.99 * (len(lat) - 1))], "prefix_hit_rate": res["prefix_hit_rate"],
                         "throughput": n / res["makespan_s"], "calls_per_replica": res["calls_per_replica"],
                         "cpu_s": time.process_time() - t0})
            r = rows[-1]
            print(f"{replicas} replicas, rate {rate} {router}: mean {r['latency_mean_s']:.0f} s, p99 "
                  f"{r['latency_p99_s']:.0f} s, hits {r['prefix_hit_rate']:.0%}, CPU {r['cpu_s']:.0f} s",
                  file=__import__("sys").stderr, flush=True)
    return rows


def plot_replicas(rows: list[dict[str, Any]], path: str) -> None:
    """Mean program latency vs arrival rate, one panel per replica count, one line per router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r["replicas"] for r in rows})
    fig, axes = plt.subplots(1, len(counts), figsize=(5.5 * len(counts), 4), squeeze=False)
    for ax, n in zip(axes[0], counts):
        mine = [r for r in rows if r["replicas"] == n]
        for name in dict.fromkeys(r["config"] for r in mine):
            pts = sorted((r["rate"], r["latency_mean_s"]) for r in mine if r["config"] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set(xlabel="arrival rate (programs/s)", ylabel="mean program latency (s)", yscale="log",
               title=f"{n} replicas, full-size agents (H100 / Llama-3.1-8B cost model)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    import argparse
    import json

    from agentrt.bench import costs

    ap = argparse.ArgumentParser(prog="agentrt simulate --replicas N",
                                 description="full-size agents over N replicas, each router at each arrival rate")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--routers", default=",".join(SIM_ROUTERS), help=f"comma-separated: {', '.join(SIM_ROUTERS)}")
    ap.add_argument("--router", default=None, help="one router (as --routers NAME)")
    ap.add_argument("--programs", type=int, default=400)
    ap.add_argument("--rates", default="0.2,0.3,0.4", help="total arrival rates, programs/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="plas")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--cost-model", default="h100-llama-3.1-8b", choices=[k for k, v in costs.NAMED.items() if v[1]])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", default=None, metavar="JSON", help="write the rows to this file too")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="plot latency vs rate per router; with --plot-from, of saved rows instead of a run")
    ap.add_argument("--plot-from", default=None, metavar="JSON,...", help="saved rows (--save) to plot, no run")
    args = ap.parse_args(argv)
    if args.plot_from:
        if not args.plot:
            ap.error("--plot-from needs --plot PNG")
        rows = []
        for name in args.plot_from.split(","):
            try:
                with open(name) as f:
                    rows += json.load(f)
            except (OSError, ValueError) as e:
                ap.error(f"--plot-from {name!r}: {e}")
        plot_replicas(rows, args.plot)
        return 0
    routers = [args.router] if args.router else [r for r in args.routers.split(",") if r]
    bad = [r for r in routers if r not in SIM_ROUTERS]
    if bad:
        ap.error(f"unknown router {bad[0]!r}; expected some of {', '.join(SIM_ROUTERS)}")
    if args.replicas < 1 or args.programs < 1:
        ap.error("--replicas and --programs must be >= 1")
    try:
        rates = [float(x) for x in args.rates.split(",")]
    except ValueError:
        ap.error(f"--rates must be numbers such as 0.2,0.3, got {args.rates!r}")
    rows = replicas_sweep(args.programs, rates, args.replicas, routers, seed=args.seed, policy=args.policy,
                          block_size=args.block_size, cost_model=args.cost_model)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot_replicas(rows, args.plot)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("| replicas | rate (programs/s) | router | mean s | p95 s | p99 s | hit rate | programs/s done "
          "| calls per replica |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['replicas']} | {r['rate']} | {r['config']} | {r['latency_mean_s']:.0f} | {r['latency_p95_s']:.0f} "
              f"| {r['latency_p99_s']:.0f} | {r['prefix_hit_rate']:.0%} | {r['throughput']:.3f} "
              f"| {' / '.join(map(str, r['calls_per_replica']))} |")
    return 0
