"""Does the simulator predict this machine? The real program benchmark and the simulator on the same workload.

    agentrt bench simcheck [--loads 0.6,0.95] [--policies fcfs,plas] [--programs 48] [--seed 5]
                           [--calibrate] [--docs]

With this machine's calibrated step costs (`agentrt simulate --calibrate`; `--calibrate` fits anew
first, and a machine without a fit is calibrated before anything else), each load is turned into an
arrival rate (the load times the simulated saturation rate of the workload); then, for each policy, the
real engine serves the workload (`agentrt bench programs`'s programs, through `agentrt.Runtime`) and the
simulator runs the same plans. Reported: mean and p95 program latency of both and their relative
difference, and the plas / fcfs ratio of each. Targets: within 20%, ratios within 0.1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import anyio

from agentrt._retention import RetentionConfig
from agentrt.bench import calibrate, costs
from agentrt.bench import programs as real
from agentrt.bench import workload as wl
from agentrt.bench.simulate import capacity, simulate
from agentrt.engine.loader import resolve_model

TARGET_REL = 0.20
TARGET_RATIO = 0.10


def run(loads: list[float], policies: list[str], n: int, seeds: list[int], cost: costs.StepCost, model: str | None,
        engine: dict[str, Any]) -> dict[str, Any]:
    """Each load x policy over the workloads of `seeds` (one real and one simulated run each); latency
    statistics over all their programs pooled."""
    caps = {seed: capacity(wl.make_workload(n, 1.0, seed), engine=engine, cost=cost) for seed in seeds}
    rows = []
    for load in loads:
        for policy in policies:
            name, kwargs = real.policy_spec(policy, argparse.Namespace(first_boundary=None, quantum=None, beta=None))
            pooled: dict[str, list[float]] = {"real": [], "sim": []}
            busy: dict[str, list[float]] = {"real": [], "sim": []}
            wall = 0.0
            for seed in seeds:
                work = wl.make_workload(n, load * caps[seed], seed)
                t0 = time.monotonic()
                measured = anyio.run(real.run_policy, name, work, model, engine, kwargs)
                wall += time.monotonic() - t0
                # the real runtime pins programs' KV across their tool gaps (retention on by default): so does the simulator
                predicted = simulate(name, work, policy_kwargs=kwargs, engine=engine, cost=cost, retention=RetentionConfig())
                for side, res in (("real", measured), ("sim", predicted)):
                    pooled[side] += [p["latency_s"] for p in res["programs"]]
                    busy[side].append(res["utilization"])
                print(f"load {load} seed {seed} {policy}: real mean "
                      f"{statistics.fmean(p['latency_s'] for p in measured['programs']):.2f} s, sim mean "
                      f"{statistics.fmean(p['latency_s'] for p in predicted['programs']):.2f} s", file=sys.stderr, flush=True)
            row = {"load": load, "rate": load * statistics.fmean(caps.values()), "policy": policy, "real_wall_s": wall}
            for side in ("real", "sim"):
                summary = real.summarize({"programs": [{"kind": "", "latency_s": x, "output_tokens": 1}
                                                       for x in pooled[side]]})["latency_s"]
                row[f"{side}_mean_s"], row[f"{side}_p95_s"] = summary["mean"], summary["p95"]
                row[f"{side}_busy"] = statistics.fmean(busy[side])
            for stat in ("mean", "p95"):
                row[f"{stat}_rel_err"] = row[f"sim_{stat}_s"] / row[f"real_{stat}_s"] - 1
            rows.append(row)
            print(f"load {load} {policy}: real mean {row['real_mean_s']:.2f} s p95 {row['real_p95_s']:.2f} s | sim mean "
                  f"{row['sim_mean_s']:.2f} s p95 {row['sim_p95_s']:.2f} s ({wall:.0f} s)", file=sys.stderr, flush=True)
    ratios = []
    if "fcfs" in policies:
        for load in loads:
            base = next(r for r in rows if r["load"] == load and r["policy"] == "fcfs")
            for r in rows:
                if r["load"] == load and r["policy"] != "fcfs":
                    real_ratio, sim_ratio = r["real_mean_s"] / base["real_mean_s"], r["sim_mean_s"] / base["sim_mean_s"]
                    ratios.append({"load": load, "policy": r["policy"], "real": real_ratio, "sim": sim_ratio,
                                   "diff": sim_ratio - real_ratio})
    ok_lat = all(abs(r[f"{s}_rel_err"]) <= TARGET_REL for r in rows for s in ("mean", "p95"))
    ok_ratio = all(abs(r["diff"]) <= TARGET_RATIO for r in ratios)
    return {"capacity_programs_per_s": statistics.fmean(caps.values()), "rows": rows, "ratios": ratios,
            "within_20pct": ok_lat, "ratios_within_0.1": ok_ratio}


def table(report: dict[str, Any]) -> str:
    lines = ["| load | programs/s | policy | real mean s | sim mean s | error | real p95 s | sim p95 s | error "
             "| engine busy real / sim |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['load']:.2f} | {r['rate']:.3f} | {r['policy']} | {r['real_mean_s']:.2f} | "
                     f"{r['sim_mean_s']:.2f} | {r['mean_rel_err']:+.0%} | {r['real_p95_s']:.2f} | {r['sim_p95_s']:.2f} "
                     f"| {r['p95_rel_err']:+.0%} | {r['real_busy']:.0%} / {r['sim_busy']:.0%} |")
    if report["ratios"]:
        lines += ["", "| load | policy / fcfs, mean latency | real | sim | difference |", "|---|---|---|---|---|"]
        for r in report["ratios"]:
            lines.append(f"| {r['load']:.2f} | {r['policy']} | {r['real']:.2f} | {r['sim']:.2f} | {r['diff']:+.2f} |")
    yes = {True: "met", False: "NOT met"}
    lines += ["", f"Targets: every simulated mean and p95 within {TARGET_REL:.0%} of the real one: "
              f"{yes[report['within_20pct']]}; policy / fcfs ratios within {TARGET_RATIO}: "
              f"{yes[report['ratios_within_0.1']]}."]
    return "\n".join(lines)


def write_docs(report: dict[str, Any], fit: costs.Fit, title: str = "Simulator calibration") -> None:
    """Replace (or append) the `## {title}` section of docs/benchmarks/simcheck.md."""
    from agentrt.bench import _common

    fit_lines = calibrate.describe(fit).replace("\n", "\n  ")
    body = "\n".join([
        f"- Step-cost fit (`agentrt simulate --calibrate`): {fit_lines}",
        f"- Workload: {report['programs']} programs of the mix ({wl.describe()}) per seed, seeds "
        f"{report['seeds']} (programs pooled); "
        f"engine {report['engine']}; mean saturation (simulated, all programs arriving at once): "
        f"{report['capacity_programs_per_s']:.3f} programs/s; each load's arrival rate = load x saturation.",
        "", table(report)])
    _common.write_section(title, body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench simcheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", default="0.6,0.95", help="fractions of the calibrated saturation")
    ap.add_argument("--policies", default="fcfs,plas")
    ap.add_argument("--programs", type=int, default=48)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=3,
                    help="workloads per load and policy (seeds --seed, --seed + 1, ...), their programs pooled: near "
                         "saturation one 48-program run's mean swings by 2x between repeats (fcfs at 0.95: 2.2-5.9 s)")
    ap.add_argument("--model", default=None, help="model path; default: the default model")
    ap.add_argument("--max-num-seqs", type=int, default=real.ENGINE["max_num_seqs"])
    ap.add_argument("--max-num-batched-tokens", type=int, default=real.ENGINE["max_num_batched_tokens"])
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="the KV cache in 16-token blocks (default: the engine's): a KV-bound engine, real and simulated")
    ap.add_argument("--tree", default=None, metavar="WIDTHxDEPTH", help="tree searches' shape (as bench programs)")
    ap.add_argument("--react-calls", default=None, metavar="N|LO-HI", help="ReAct loops' calls (as bench programs)")
    ap.add_argument("--mix", default=None, metavar="KIND=WEIGHT,...", help="the program mix (as bench programs)")
    ap.add_argument("--calibrate", action="store_true", help="calibrate this machine first (and store the fit)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--docs", action="store_true", help="write the section of docs/benchmarks/simcheck.md")
    args = ap.parse_args(argv)
    resolve_model(args.model)  # a path that is not a model fails first, in one line
    try:
        loads = [float(x) for x in args.loads.split(",")]
        if min(loads) <= 0:
            raise ValueError
    except ValueError:
        raise SystemExit(f"--loads must be fractions of saturation > 0 such as 0.6,0.95, got {args.loads!r}") from None
    if args.programs < 1:
        raise SystemExit(f"--programs must be >= 1, got {args.programs!r}")
    real.apply_workload_options(args)
    policies = args.policies.split(",")
    for p in policies:
        real.policy_spec(p, argparse.Namespace(first_boundary=None, quantum=None, beta=None))
    key = costs.fit_key(*costs.default_model_and_dtype(args.model))
    fit = None if args.calibrate else costs.load(key)
    if fit is None:
        print("agentrt bench simcheck: calibrating this machine first", file=sys.stderr)
        fit, _ = calibrate.calibrate(args.model)
        costs.store(fit)
    print(calibrate.describe(fit), file=sys.stderr)
    engine = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    if args.num_blocks is not None:
        if args.num_blocks < 1:
            raise SystemExit(f"--num-blocks must be >= 1, got {args.num_blocks!r}")
        engine["num_blocks"] = args.num_blocks
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be >= 1, got {args.seeds!r}")
    seeds = list(range(args.seed, args.seed + args.seeds))
    report = run(loads, policies, args.programs, seeds, fit.cost, args.model, engine)
    report.update(programs=args.programs, seeds=seeds, engine=engine, fit=fit.key)
    print(json.dumps(report, indent=2) if args.json else table(report))
    if args.docs:
        write_docs(report, fit, "Simulator calibration" + (", KV-bound" if args.num_blocks is not None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
