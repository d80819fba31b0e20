"""Scheduling simulator: the benchmark's program mix against the engine's own scheduler, in virtual time.

    agentrt simulate [--programs N] [--rate R | --load U] [--policies fcfs,plas,...] [--json]
    agentrt simulate --calibrate                   # time this machine's engine, store the step-cost fit
    agentrt simulate agents --cost-model NAME      # full-size agents on a named GPU cost model

What is real: `engine.scheduler.Scheduler`, `engine.kv_cache_manager.KVCacheManager`, `Request` and
the policies, exactly as the engine runs them (admission, chunked prefill, prefix hits, preemption,
service attribution). What is modeled: the forward pass, by a linear step-cost model over the step's
tokens, decode rows, context, prefill attention pairs and sampled rows (`agentrt/bench/costs.py`): by default the
fit `agentrt simulate --calibrate` stored for this machine, model and dtype (a warning and a built-in
model without one), or a named model (`--cost-model`), or `--cost`. Every request that reaches the end of
its known tokens samples a random token. Programs are the plans of `agentrt/bench/workload.py`; tool calls take their planned time.

It runs the default 96-program mix in a few seconds per policy (the real engine: six minutes), so load
sweeps, mixes and policy settings can be explored before the real run, which is what
docs/benchmarks/simulate.md reports beside the sweeps.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Any

import agentrt.policies  # noqa: F401  (registers plas / atlas / mlfq)
from agentrt._retention import RetentionConfig
from agentrt.bench import costs, sim_run, sim_tiers
from agentrt.bench import workload as wl
from agentrt.bench.costs import StepCost
from agentrt.bench.sim_run import agent_engine, capacity, simulate
from agentrt.policies.autellix import TTL_SETTINGS


# PLAS as Autellix describes it (and as agentrt's defaults were before issue 47): displacement for blocks too,
# no admission control, the reimplementation's beta 8
AUTELLIX: dict[str, Any] = {"preempt": True, "protect_pins": False, "beta": 8.0, "num_queues": 4, "boundary_programs": None,
                             "pins_by_rank": False, "headroom": False, "prefill_yield": False,
                             "backfill_s": None}
AGENT_CONFIGS: dict[str, tuple[str, dict[str, Any], bool]] = {  # name -> (policy, its kwargs, TTL pins)
    "fcfs": ("fcfs", {}, False),  # vLLM-like: call-level FCFS, LRU prefix cache
    # Continuum-like: pins; program-level FCFS (a one-queue PLAS orders by program start), pinned programs first
    "fcfs+ttl": ("plas", {"num_queues": 1, "pinned_first": True, "protect_pins": False, "pins_by_rank": False}, True),
    "plas": ("plas", dict(AUTELLIX), False),  # Autellix-like: the paper's PLAS, before agentrt's defaults
    "plas+ttl": ("plas", dict(TTL_SETTINGS), True),  # ours: PLAS composed with TTL (agentrt/policies/autellix.py)
    # ablation, not in the default sweep: the Continuum-like order with our admission control
    "fcfs+ttl+guard": ("plas", {"num_queues": 1, "pinned_first": True, "protect_pins": True, "pins_by_rank": False},
                       True),
    # ours with the running-set cap at the knee of the step cost (issue 37), not in the default sweep
    "plas+ttl+cap": ("plas", {**TTL_SETTINGS, "running_cap": "auto"}, True),
    # ours over KV tiers below the cache (host memory, local NVMe: agentrt/bench/sim_tiers.py H100_TIERS), not in the default
    "plas+ttl+tiers": ("plas", dict(TTL_SETTINGS), True),
}
TIERED = {"plas+ttl+tiers": sim_tiers.H100_TIERS}  # configs run over KV tiers, and their tiers
DEFAULT_AGENT_CONFIGS = ("fcfs", "fcfs+ttl", "plas", "plas+ttl")


def agents_sweep(n: int, rates: list[float], seed: int, configs: list[str], block_size: int = 256,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 cost_model: str = "h100-llama-3.1-8b") -> list[dict[str, Any]]:
    """Full-size agents (agentrt/bench/workload.py CODING_FULL / REACT_FULL) on a named GPU cost model (agentrt/bench/costs.py):
    each config at each arrival rate. Blocks of `block_size` tokens (coarser than the engine's 16, so a
    thousand programs of tens of thousands of tokens simulate in minutes; hits are at that granularity)."""
    import time as _time

    cost, engine = agent_engine(cost_model, block_size, max_num_seqs, max_num_batched_tokens)
    rows = []
    for rate in rates:
        work = wl.make_agent_workload(n, rate, seed)
        for name in configs:
            policy, kwargs, ttl = AGENT_CONFIGS[name]
            t0, c0 = _time.perf_counter(), _time.process_time()
            res = simulate(policy, work, policy_kwargs=kwargs, engine=engine, cost=cost,
                           retention=RetentionConfig(ttl=ttl), tiers=TIERED.get(name))
            lat = sorted(p["latency_s"] for p in res["programs"])
            rows.append({"config": name, "rate": rate, "programs": n, "wall_s": _time.perf_counter() - t0,
                         "cpu_s": _time.process_time() - c0,  # this process's CPU time: wall less waiting for the CPU
                         "latency_mean_s": sum(lat) / len(lat), "latency_p95_s": lat[int(0.95 * (len(lat) - 1))],
                         "recomputed_prefill_tokens": res["recomputed_prefill_tokens"],
                         "prefix_hit_rate": res["prefix_hit_rate"], "ttl_hits": res["ttl_hits"],
                         "ttl_misses": res["ttl_misses"], "preemptions": res["preemptions"],
                         "pinned_block_s": res["pinned_block_s"], "tier_hits": res["tier_hits"]})
            print(f"rate {rate} {name}: mean {rows[-1]['latency_mean_s']:.0f} s, wall {rows[-1]['wall_s']:.0f} s, "
                  f"CPU {rows[-1]['cpu_s']:.0f} s",
                  file=sys.stderr, flush=True)
    return rows


def rate_at_latency(rows: list[dict[str, Any]], config: str, latency_s: float) -> float | None:
    """The arrival rate at which `config`'s mean program latency reaches `latency_s` (linear interpolation
    between swept rates); None if it never does within the sweep (or is above it from the start)."""
    pts = sorted((r["rate"], r["latency_mean_s"]) for r in rows if r["config"] == config)
    if not pts or pts[0][1] > latency_s:
        return None
    for (r0, l0), (r1, l1) in itertools.pairwise(pts):
        if l1 >= latency_s:
            return r0 + (r1 - r0) * (latency_s - l0) / (l1 - l0) if l1 > l0 else r1
    return None


def plot_agents(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["config"] for r in rows):
        pts = sorted((r["rate"], r["latency_mean_s"], r["recomputed_prefill_tokens"]) for r in rows if r["config"] == name)
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        axes[1].plot([p[0] for p in pts], [p[2] / 1e6 for p in pts], marker="o", label=name)
    axes[0].set(xlabel="arrival rate (programs/s)", ylabel="mean program latency (s)", yscale="log",
                title="Full-size agents, Llama-3.1-8B / H100 cost model")
    axes[1].set(xlabel="arrival rate (programs/s)", ylabel="recomputed prefill tokens (M)",
                title="Prompt tokens recomputed across a program's calls")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def agents_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="agentrt simulate agents", description="full-size agents: fcfs / fcfs+ttl / "
                                 "plas / plas+ttl program latency vs arrival rate (Llama-3.1-8B on one H100, modeled)")
    ap.add_argument("--programs", type=int, default=200)
    ap.add_argument("--rates", default="0.02,0.04,0.06,0.08")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(DEFAULT_AGENT_CONFIGS), help=f"of {', '.join(AGENT_CONFIGS)}")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--cost-model", default="h100-llama-3.1-8b", choices=[k for k, v in costs.NAMED.items() if v[1]],
                    help="the GPU step-cost model (agentrt/bench/costs.py states each one's figures and sources)")
    ap.add_argument("--plot", default=None, metavar="PNG", help="write the latency / recompute plot here")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write-docs", default=None, metavar="TITLE",
                    help="write the table, each config's rate at the first config's latencies and the plot (--plot) "
                         "into docs/benchmarks/simulate.md under this title")
    args = ap.parse_args(argv)
    try:
        rates = [float(x) for x in args.rates.split(",")]
    except ValueError:
        raise SystemExit(f"--rates must be numbers such as 0.02,0.04, got {args.rates!r}") from None
    configs = args.configs.split(",")
    bad = [c for c in configs if c not in AGENT_CONFIGS]
    if bad:
        raise SystemExit(f"unknown config {bad[0]!r}; known: {', '.join(AGENT_CONFIGS)}")
    print(f"agentrt simulate agents: step costs: {args.cost_model} ({costs.named(args.cost_model)[2]})", file=sys.stderr)
    rows = agents_sweep(args.programs, rates, args.seed, configs, args.block_size, cost_model=args.cost_model)
    if args.plot:
        plot_agents(rows, args.plot)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    text = agents_table(rows) + "\n\n" + rates_at_equal_latency(rows, configs)
    print(text)
    if args.write_docs:
        from agentrt.bench import _common

        plot = f"\n\n![{args.write_docs}]({os.path.relpath(args.plot, 'docs')})" if args.plot else ""
        _common.write_section(args.write_docs, f"{args.programs} full-size agents (CODING_FULL / REACT_FULL, "
                              f"agentrt/bench/workload.py), step costs {args.cost_model} ({costs.named(args.cost_model)[2]}), "
                              f"blocks of {args.block_size} tokens.\n\n{text}{plot}")
    return 0


def agents_table(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        tier_hits = ", ".join(f"{k} {v:,}" for k, v in r["tier_hits"].items()) or "-"
        out.append([r["rate"], r["config"], f"{r['latency_mean_s']:.0f}", f"{r['latency_p95_s']:.0f}",
                    f"{r['recomputed_prefill_tokens']:,}", f"{r['prefix_hit_rate']:.0%}", tier_hits,
                    f"{r['ttl_hits']} / {r['ttl_misses']}", f"{r['pinned_block_s']:,.0f}", r["preemptions"],
                    f"{r['wall_s']:.0f}", f"{r['cpu_s']:.0f}"])
    from agentrt.bench import _common

    return _common.markdown_table(
        ["rate (programs/s)", "config", "mean s", "p95 s", "recomputed prefill tokens", "hit rate", "tier hits (blocks)",
         "TTL hits / misses", "pinned block-s", "preemptions", "wall s", "CPU s"], out)


def rates_at_equal_latency(rows: list[dict[str, Any]], configs: list[str]) -> str:
    """For each swept latency of the first config, the rate each other config sustains at that mean latency, and
    the pinned block-seconds at each rate both ran, as ratios to the first config's."""
    base = configs[0]
    lines = []
    for r in sorted((r for r in rows if r["config"] == base), key=lambda r: r["rate"]):
        parts = []
        for name in configs[1:]:
            rate = rate_at_latency(rows, name, r["latency_mean_s"])
            got = "beyond the sweep" if rate is None else f"{rate:.3f}/s ({rate / r['rate']:.2f}x)"
            parts.append(f"{name} {got}")
        lines.append(f"- at {base}'s mean of {r['latency_mean_s']:.0f} s ({r['rate']}/s): " + ", ".join(parts))
    for name in configs[1:]:
        pairs = [(a, b) for a in rows for b in rows if a["config"] == base and b["config"] == name and a["rate"] == b["rate"]]
        if pairs:
            ratios = ", ".join(f"{a['rate']}/s {a['pinned_block_s'] / max(b['pinned_block_s'], 1):,.0f}x"
                               for a, b in pairs)
            lines.append(f"- pinned block-seconds, {base} / {name}: {ratios}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from agentrt.bench import programs as real  # the report format and the policy-entry syntax of the real benchmark

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--replicas" or a.startswith("--replicas=") for a in argv):  # N engines behind a router
        from agentrt.bench import sim_replicas

        return sim_replicas.main([a for a in argv if a != "agents"])
    if argv[:1] == ["agents"]:
        return agents_main(argv[1:])
    if "--calibrate" in argv:
        from agentrt.bench import calibrate

        return calibrate.main([a for a in argv if a != "--calibrate"])

    ap = argparse.ArgumentParser(prog="agentrt bench simulate", description=__doc__.split("\n\n")[0])
    real.add_common_args(ap)
    ap.add_argument("--cost", default=None, metavar="BASE,TOKEN,DECODE_ROW,CONTEXT[,PREFILL_ATTN[,SAMPLE[,SHARED_CONTEXT]]]",
                    help="step-cost model in seconds (default: this machine's calibrated fit, see --calibrate)")
    ap.add_argument("--cost-model", default=None, choices=list(costs.NAMED),
                    help="a named step-cost model instead of this machine's fit (agentrt/bench/costs.py states their sources)")
    ap.add_argument("--capacity", action="store_true",
                    help="also print the saturation rate: programs/s completed when all arrive at once")
    ap.add_argument("--loads", default=None, metavar="U1,U2,...",
                    help="sweep instead: arrival rates as fractions of the saturation rate (e.g. 0.7,0.8,0.9,1.0); "
                         "reports each policy's mean and p99 latency vs fcfs, averaged over --seeds")
    ap.add_argument("--seeds", type=int, default=3, help="workload seeds per load in a sweep (from --seed on)")
    ap.add_argument("--like-http", action="store_true",
                    help="as `agentrt bench programs --http` serves them: TTL pins across tool calls (the server's "
                         "retention), and no program ever says it ended (an OpenAI client just stops calling)")
    args = ap.parse_args(argv)
    cost, cost_line = resolve_cost(args)
    workload, engine = real.setup(args, cost)  # bad arguments end here, before anything is said
    print(cost_line, file=sys.stderr)
    if args.loads is not None:
        try:
            loads = [float(x) for x in args.loads.split(",")]
            if not loads or min(loads) <= 0:
                raise ValueError
        except ValueError:
            raise SystemExit(f"--loads must be positive numbers such as 0.8,0.9,1.0, got {args.loads!r}") from None
        if args.seeds < 1:
            raise SystemExit(f"--seeds must be >= 1, got {args.seeds!r}")
        rows = sweep(args, loads, engine, cost)
        print(json.dumps(rows, indent=2) if args.json else sweep_table(rows))
        return 0
    report = real.new_report(args, engine)
    for entry in args.policies.split(","):
        name, kwargs = real.policy_spec(entry, args)
        res = simulate(name, workload, policy_kwargs=kwargs, engine=engine, cost=cost, **like_http(args))
        report["results"][entry] = real.summarize(res)
    real.add_ratios(report)
    if args.capacity:
        report["capacity_programs_per_s"] = cap = capacity(workload, engine=engine, cost=cost)
        if not args.json:
            print(f"saturation: {cap:.3f} programs/s (this run: {args.rate / cap:.2f} of it)")
    if not args.json:
        print(f"arrival rate {args.rate:.3f} programs/s{real.load_note(report['config'])}")
    print(json.dumps(report, indent=2) if args.json else real.table(report))
    return 0


def like_http(args: argparse.Namespace) -> dict[str, Any]:
    """`simulate`'s arguments for --like-http (none without it)."""
    return sim_run.like_http() if getattr(args, "like_http", False) else {}


def resolve_cost(args: argparse.Namespace) -> tuple[StepCost, str]:
    """--cost, else --cost-model, else this machine's stored fit (a warning and the built-in model without
    one); and the line that says which."""
    if args.cost is not None:
        cost, line = StepCost.parse(args.cost), f"step costs: --cost {args.cost}"
    elif args.cost_model is not None:
        cost, _, source = costs.named(args.cost_model)
        line = f"step costs: {args.cost_model} ({source})"
    else:
        cost, line = costs.for_this_machine(getattr(args, "model", None), quiet=True)
    return cost, f"agentrt simulate: {line}"


def sweep(args: argparse.Namespace, loads: list[float], engine: dict[str, Any], cost: StepCost) -> list[dict[str, Any]]:
    """Each load x seed: every policy on the same workload; ratios to fcfs, averaged over seeds."""
    from agentrt.bench import programs as real

    entries = args.policies.split(",")
    specs = {e: real.policy_spec(e, args) for e in entries}
    rows = []
    for load in loads:
        ratios: dict[str, dict[str, list[float]]] = {e: {"mean": [], "p99": []} for e in entries if e != "fcfs"}
        rates = []
        for seed in range(args.seed, args.seed + args.seeds):
            rate = load * capacity(wl.make_workload(args.programs, 1.0, seed), engine=engine, cost=cost)
            work = wl.make_workload(args.programs, rate, seed)
            base = real.summarize(simulate("fcfs", work, engine=engine, cost=cost, **like_http(args)))["latency_s"]
            rates.append(rate)
            for e in ratios:
                name, kwargs = specs[e]
                lat = real.summarize(simulate(name, work, policy_kwargs=kwargs, engine=engine, cost=cost,
                                              **like_http(args)))["latency_s"]
                ratios[e]["mean"].append(lat["mean"] / base["mean"])
                ratios[e]["p99"].append(lat["p99"] / base["p99"])
        rows.append({"load": load, "rate": sum(rates) / len(rates), "seeds": args.seeds,
                     "vs_fcfs": {e: {k: sum(v) / len(v) for k, v in r.items()} for e, r in ratios.items()}})
    return rows


def sweep_table(rows: list[dict[str, Any]]) -> str:
    entries = list(rows[0]["vs_fcfs"]) if rows else []
    lines = ["| load (x saturation) | programs/s | " + " | ".join(f"{e} mean / p99 vs fcfs" for e in entries) + " |",
             "|---|---|" + "---|" * len(entries)]
    for r in rows:
        cells = " | ".join(f"{r['vs_fcfs'][e]['mean']:.2f}x / {r['vs_fcfs'][e]['p99']:.2f}x" for e in entries)
        lines.append(f"| {r['load']:.2f} | {r['rate']:.3f} | {cells} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
