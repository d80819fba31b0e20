"""Program-scheduling benchmark: one program mix, Poisson arrivals, every policy in one run.

    agentrt bench programs [--json] [--programs N] [--rate R] [--policies fcfs,mlfq,plas,atlas]
                           [--http [--timeline PNG]]
    python -m agentrt.bench.programs ...

The mix (chat, ReAct, tree search after Autellix) is defined once, as plans, in
`agentrt/bench/workload.py`; `agentrt bench simulate` runs the same plans in virtual time.

Outputs ignore EOS so every policy does the same work. Program latency runs from its planned arrival
to its end; FCFS is the peer, measured in the same run, and every other policy is reported as a
ratio to it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

import agentrt
from agentrt.bench import _common
from agentrt.bench import workload as wl
from agentrt.bench.workload import REACT, TREE, Call, Parallel, ProgramSpec, make_workload, tokens
from agentrt.engine.loader import resolve_model
from agentrt.policies import RUNNING_CAP_FORMS, parse_running_cap

ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 256}  # few seats: the policies must choose


async def _call(call: Call) -> list[int]:
    """The call's generated token ids, as the engine produced them (re-tokenizing the text could give other
    ids, and the simulator, which runs the same plans, could then not match the real run's prompts)."""
    res = await agentrt.generate(call.prompt, max_tokens=call.max_tokens, ignore_eos=True, temperature=0.0, full=True)
    return list(res.choices[0].token_ids)


@agentrt.tool(name="search")
async def _tool(seconds: float, observation: list[int]) -> list[int]:
    await anyio.sleep(seconds)
    return observation


def _program(kind: str):
    async def run(spec: ProgramSpec) -> str | None:
        """Drive the kind's plan (agentrt/bench/workload.py): calls, parallel branches, tool gaps."""
        gen, value = wl.plan(spec), None
        while True:
            try:
                action = gen.send(value)
            except StopIteration:
                return agentrt.current_program_id()
            if isinstance(action, Call):
                value = await _call(action)
            elif isinstance(action, Parallel):
                value = await agentrt.gather(*(_call(c) for c in action.calls))
            else:
                value = await _tool(action.seconds, action.observation)

    run.__name__ = run.__qualname__ = f"{kind}_program"
    return agentrt.program(name=kind)(run)


PROGRAMS = {kind: _program(kind) for kind in wl.PLANS}


async def run_policy(
    policy: str, workload: list[ProgramSpec], model: str | None, engine: dict[str, Any], policy_kwargs: dict[str, Any],
    breakdown: Any = None,
) -> dict[str, Any]:
    """Serve the workload under one policy; per-program results plus engine counters. `breakdown`: a step-cost
    model (`agentrt.bench.costs.StepCost`) to split each program's time into its parts with (agentrt/bench/breakdown.py)."""
    results: list[dict[str, Any] | None] = [None] * len(workload)
    async with agentrt.Runtime(model, policy=policy, policy_kwargs=policy_kwargs or None, **engine) as rt:
        await agentrt.generate(tokens(random.Random(0), 64), max_tokens=4)  # warm-up, not measured
        core = rt.engine.core
        log = None
        if breakdown is not None:
            from agentrt.bench.breakdown import StepLog

            log = core.on_schedule = StepLog(core)
        busy0, steps0, tokens0 = core.busy_s, core.num_steps, core.num_computed_tokens
        start = time.monotonic()

        async def launch(spec: ProgramSpec) -> None:
            await anyio.sleep(max(0.0, start + spec.arrival_s - time.monotonic()))
            pid = await PROGRAMS[spec.kind](spec)
            info = rt.programs[pid]
            latency = time.monotonic() - (start + spec.arrival_s)
            results[spec.index] = {"kind": spec.kind, "latency_s": latency, "calls": info.calls_done,
                                    "output_tokens": info.num_output_tokens, "program_id": pid}

        async with anyio.create_task_group() as tg:
            for spec in workload:
                tg.start_soon(launch, spec)
        makespan = time.monotonic() - start
        busy = core.busy_s - busy0
        steps, computed = core.num_steps - steps0, core.num_computed_tokens - tokens0
        kv = rt.kv_stats()
        core.on_schedule = None
    parts = {}
    if log is not None:
        from agentrt.bench import breakdown as bd

        done = {r["program_id"]: r for r in results if r is not None}
        parts = bd.by_class(bd.call_parts(log, breakdown), done, LONG_KINDS)
    return {
        "breakdown": parts,
        "policy": policy,
        "makespan_s": makespan,
        "utilization": busy / makespan,  # fraction of the run the engine was executing steps
        "steps": steps,
        "computed_tokens": computed,  # prompt (not cached) + output + recomputed tokens
        "preemptions": kv.num_preemptions,
        "prefix_hit_rate": kv.prefix_hit_tokens / max(1, kv.prefix_queries_tokens),
        "programs": [r for r in results if r is not None],
    }


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's runs over several seeds as one result: every program of every run, the makespan and the
    busy fraction averaged over the runs, counters summed (the first run's timeline kept)."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    out["programs"] = [p for r in runs for p in r["programs"]]
    out["makespan_s"] = statistics.fmean(r["makespan_s"] for r in runs)
    out["makespans_s"] = [r["makespan_s"] for r in runs]
    out["utilization"] = statistics.fmean(r["utilization"] for r in runs)
    out["prefix_hit_rate"] = statistics.fmean(r["prefix_hit_rate"] for r in runs)
    for key in ("steps", "computed_tokens", "preemptions", "recomputed_prefill_tokens"):
        if key in runs[0]:
            out[key] = sum(r[key] for r in runs)
    if "engine_samples" in runs[0]:  # --http: the sampled running / waiting / KV figures, averaged over the runs
        out["engine_samples"] = {k: statistics.fmean(r["engine_samples"][k] for r in runs)
                                 for k in runs[0]["engine_samples"]}
    if runs[0].get("breakdown"):  # each class's parts, weighted by its programs in each run
        out["breakdown"] = {}
        for cls in runs[0]["breakdown"]:
            rows = [r["breakdown"][cls] for r in runs if cls in r.get("breakdown", {})]
            n = sum(row["programs"] for row in rows)
            out["breakdown"][cls] = {k: (n if k == "programs" else sum(row[k] * row["programs"] for row in rows) / n)
                                     for k in rows[0]}
    return out


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Add latency statistics (all programs, per generated token, by kind) to a run's raw result."""
    done = res["programs"]
    return {
        **res,
        "latency_s": _summary([r["latency_s"] for r in done]),
        "latency_per_token_s": _summary([r["latency_s"] / max(1, r["output_tokens"]) for r in done]),
        "by_kind": {k: _summary([r["latency_s"] for r in done if r["kind"] == k]) for k in wl.PLANS},
        "by_class": {"short": _summary([r["latency_s"] for r in done if r["kind"] not in LONG_KINDS]),
                     "long": _summary([r["latency_s"] for r in done if r["kind"] in LONG_KINDS])},
    }


def _summary(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]

    return {"mean": statistics.fmean(s), "p50": pct(0.5), "p95": pct(0.95), "p99": pct(0.99), "n": len(s)}


def add_ratios(report: dict[str, Any]) -> None:
    base = report["results"].get("fcfs")
    if base is None:
        return
    for res in report["results"].values():
        res["vs_fcfs"] = {
            f"{metric}.{stat}": res[metric][stat] / base[metric][stat]
            for metric in ("latency_s", "latency_per_token_s")
            for stat in ("mean", "p50", "p95", "p99")
        }
        for cls in ("short", "long"):
            mine, theirs = res.get("by_class", {}).get(cls), base.get("by_class", {}).get(cls)
            if mine and theirs:
                res["vs_fcfs"][f"{cls}.mean"] = mine["mean"] / theirs["mean"]
                res["vs_fcfs"][f"{cls}.p99"] = mine["p99"] / theirs["p99"]
        res["vs_fcfs"]["makespan"] = res["makespan_s"] / base["makespan_s"]


def table(report: dict[str, Any]) -> str:
    lines = [
        "| policy | mean s | p50 s | p95 s | p99 s | mean s/token | mean vs fcfs | p99 vs fcfs | s/token vs fcfs "
        "| mean s by kind | makespan s | busy | engine tok/s | preemptions |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        lat, tok, vs = r["latency_s"], r["latency_per_token_s"], r.get("vs_fcfs", {})
        kinds = " / ".join(f"{k} {v['mean']:.1f}" for k, v in r["by_kind"].items() if v)
        lines.append(
            f"| {name} | {lat['mean']:.2f} | {lat['p50']:.2f} | {lat['p95']:.2f} | {lat['p99']:.2f} | {tok['mean']:.3f} "
            f"| {vs.get('latency_s.mean', float('nan')):.2f}x | {vs.get('latency_s.p99', float('nan')):.2f}x "
            f"| {vs.get('latency_per_token_s.mean', float('nan')):.2f}x | {kinds} | {r['makespan_s']:.0f} "
            f"| {r['utilization']:.0%} | {_engine_speed(r)} | {r['preemptions']} |"
        )
    return "\n".join(lines)


def _engine_speed(r: dict[str, Any]) -> str:
    """Tokens computed per second of model execution. Policies that compute about the same tokens should
    read about the same (MLFQ reads higher: it recomputes preempted prompts, and prefill tokens are
    cheap); a row that reads lower than FCFS's ran on a slower stretch of the shared machine."""
    busy = r["utilization"] * r["makespan_s"]
    return f"{r['computed_tokens'] / busy:.0f}" if "computed_tokens" in r and busy > 0 else "-"


def write_docs(report: dict[str, Any], path: Path | None = None) -> Path:
    """This run as a section of docs/benchmarks/programs.md (or `path`): newest first, the run of the same title it
    replaces moved into History. The title says the setting: "Program scheduling", over HTTP, KV-bound, host tier."""
    cfg = report["config"]
    engine = cfg["engine"]
    title = "Program scheduling" + (" over HTTP" if cfg.get("http") else "")
    if engine.get("num_blocks") is not None:
        title += f", KV-bound ({engine['num_blocks']} blocks" + (", host tier)" if engine.get("kv_host_gib") else ")")
    parts = [
        f"Workload: {cfg['programs']} programs, Poisson arrivals at {cfg['rate']:.3f} programs/s{load_note(cfg)}, "
        f"{_seeds_note(cfg)}: {wl.describe()}; engine {engine}, default policy settings. Program latency = planned "
        "arrival to program end; per token = latency / tokens the program generated.",
        "",
        table(report),
    ]
    if any("http_breakdown" in r for r in report["results"].values()):
        from agentrt.bench import programs_http

        parts += ["", "Where the time goes (mean per program; from the server's program records and /metrics samples):",
                  "", programs_http.breakdown_table(report["results"])]
    if "simulated" in report:
        parts += ["", SIM_NOTE, "", simulated_table(report)]
        if "step_costs" in report["config"]:
            parts += ["", f"The simulator's {report['config']['step_costs']}."]
        if "simulated_knee" in report:
            parts += ["", knee_line(report)]
    return _common.write_section(title, "\n".join(parts), path, name="programs")


SIM_NOTE = ("Simulated against real (`agentrt bench simulate --like-http`: this machine's calibrated step costs, the same "
            "workloads and rate, pins as the server keeps them, no program ever ended by its client):")


def simulated(report: dict[str, Any], policies: list[str], workloads: list[list[ProgramSpec]],
              engine: dict[str, Any], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """The simulator on the same workloads as a served run (agentrt/bench/simulate.py --like-http): each policy's
    mean latency, all programs and by class, pooled over the seeds as the real run's."""
    from agentrt.bench import costs
    from agentrt.bench.sim_run import like_http, served_knee, simulate

    cost, line = costs.for_this_machine(report["config"].get("model"), quiet=True)
    report["config"]["step_costs"] = line
    out = {}
    for policy in policies:
        name, kwargs = policy_spec(policy, args)
        res = summarize(pool([simulate(name, work, policy_kwargs=kwargs, engine=engine, cost=cost, **like_http())
                              for work in workloads]))
        out[policy] = {"mean": res["latency_s"]["mean"], "short": res["by_class"]["short"].get("mean", float("nan")),
                       "long": res["by_class"]["long"].get("mean", float("nan"))}
    if sat := report["config"].get("saturation"):  # the server's knee, measured: the simulator's, measured alike
        drawn = make_workload(max(len(workloads[0]), 400), 1.0, report["config"]["seed"])
        report["simulated_knee"] = served_knee(drawn, engine=engine, cost=cost,
                                               levels=tuple(sorted(int(n) for n in sat["curve"])), **like_http())
    return out


def knee_line(report: dict[str, Any]) -> str:
    """The served and the simulated saturation side by side, each measured as `--load` measures it (issue 47 item 4:
    where the simulator's contention departs from the server's)."""
    sat, sim = report["config"]["saturation"], report["simulated_knee"]
    served = ", ".join(f"{int(n)}: {c['output_tok_s']:.0f}" for n, c in sorted(sat["curve"].items(), key=lambda x: int(x[0])))
    simulated = ", ".join(f"{n}: {v:.0f}" for n, v in sim["curve"].items())
    return (f"Saturation, output tokens a second by programs in flight (a closed loop of the mix, as `--load` measures "
            f"it; FCFS): served {served}; simulated {simulated}.")


def simulated_table(report: dict[str, Any]) -> str:
    """Real and simulated mean latency per policy, and each one's ratio to fcfs (issue 47: within 0.1)."""
    sim, real = report["simulated"], report["results"]
    lines = ["| policy | real mean s | simulated mean s | real short / long s | simulated short / long s "
             "| real vs fcfs | simulated vs fcfs | difference |", "|---|---|---|---|---|---|---|---|"]
    for policy, s in sim.items():
        r = real[policy]
        rr = r["latency_s"]["mean"] / real["fcfs"]["latency_s"]["mean"] if "fcfs" in real else float("nan")
        sr = s["mean"] / sim["fcfs"]["mean"] if "fcfs" in sim else float("nan")
        lines.append(f"| {policy} | {r['latency_s']['mean']:.2f} | {s['mean']:.2f} | "
                     f"{r['by_class']['short'].get('mean', float('nan')):.1f} / "
                     f"{r['by_class']['long'].get('mean', float('nan')):.1f} | {s['short']:.1f} / {s['long']:.1f} "
                     f"| {rr:.2f} | {sr:.2f} | {sr - rr:+.2f} |")
    return "\n".join(lines)


def _seeds_note(cfg: dict[str, Any]) -> str:
    n = cfg.get("seeds", 1)
    return f"seed {cfg['seed']}" if n == 1 else f"seeds {cfg['seed']}-{cfg['seed'] + n - 1} pooled (makespan averaged)"


def load_note(cfg: dict[str, Any]) -> str:
    if cfg.get("load") is None:
        return ""
    how = "measured" if cfg.get("saturation") else "calibrated"
    return f" (load {cfg['load']:.2f} of the {how} saturation, {cfg['capacity_programs_per_s']:.3f} programs/s)"


def _flag(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


_flag.__name__ = "a flag (1/0, true/false)"


def _preempt(value: str) -> bool | str:
    return "seats" if value == "seats" else _flag(value)


_preempt.__name__ = "a flag (1/0, true/false) or 'seats'"


def _cap(value: str) -> int | str:
    return parse_running_cap(value)


_cap.__name__ = RUNNING_CAP_FORMS
def _optional_float(value: str) -> float | None:
    return None if value.lower() == "none" else float(value)


_optional_float.__name__ = "a number or None"


def _flag_or_int(value: str) -> bool | int:
    return int(value) if value.strip().isdigit() and int(value) > 1 else _flag(value)


_flag_or_int.__name__ = "a flag (1/0, true/false) or a token count > 1"
_KNOBS: dict[str, Any] = {"first_boundary": float, "boundary_calls": float, "boundary_programs": _optional_float,
                          "quantum": float, "beta": float, "num_queues": int, "order": str, "live": _flag,
                          "running_cap": _cap, "preempt": _preempt, "victim": str, "pinned_first": _flag,
                          "protect_pins": _flag, "pins_by_rank": _flag, "new_take_pins": _flag, "headroom": _flag,
                          "prefill_yield": _flag_or_int, "yield_to": str, "backfill_s": _optional_float}


_POLICIES = ("fcfs", "mlfq", "plas", "atlas", "plas+ttl", "atlas+ttl")
LONG_KINDS = ("tree", "steps")  # the long class of programs (many calls, fan-out); the others are short


def policy_spec(policy: str, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """"NAME[:np][:KEY=VALUE...]" -> (name, policy kwargs): `np` = without preemption; KEY is one of
    first_boundary, boundary_calls, quantum, beta, num_queues, order, live, running_cap, preempt, victim,
    pinned_first, protect_pins (plas/atlas; quantum also mlfq),
    overriding the command-line value for this entry only, e.g. `plas:beta=2`, `plas:order=call:live=0`
    or `plas:running_cap=auto`."""
    name, *variants = policy.split(":")
    if name not in _POLICIES:
        raise SystemExit(f"unknown policy {name!r} in --policies: choose from {', '.join(_POLICIES)}")
    given = {"first_boundary": args.first_boundary, "quantum": args.quantum, "beta": args.beta}
    allowed = {"mlfq": {"quantum"}}.get(name, set(_KNOBS) if name.startswith(("plas", "atlas")) else set())
    kwargs = {k: v for k, v in given.items() if k in allowed and v is not None}
    for variant in variants:
        key, eq, value = variant.partition("=")
        if variant == "np":
            kwargs["preempt"] = False
        elif eq and key in allowed:
            try:
                kwargs[key] = _KNOBS[key](value)
            except ValueError:
                raise SystemExit(f"{policy!r}: {key} must be {_KNOBS[key].__name__}, got {value!r}") from None
        else:
            raise SystemExit(f"unknown policy variant {variant!r} in {policy!r}: use NAME, NAME:np or "
                             f"NAME:KEY=VALUE with KEY in {sorted(allowed) or 'nothing for ' + name}")
    return name, kwargs


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """The workload, engine and policy options shared with `agentrt bench simulate`."""
    ap.add_argument("--programs", type=int, default=160,
                    help="programs per policy (with fewer, one run's mean and p99 swing with the seed: simulated "
                         "PLAS / fcfs over seeds 0-3 is 0.47-0.57x at 96 programs, 0.48-0.50x at 160)")
    ap.add_argument("--rate", type=float, default=None,
                    help="program arrivals per second (Poisson); default: --load 0.9. Saturation differs by machine "
                         "(the default mix: ~0.27/s on a 2-core AVX2 CPU in fp32, ~1.9/s on an AVX512-BF16 one)")
    ap.add_argument("--load", type=float, default=None,
                    help="instead of --rate: the arrival rate as a fraction of this machine's saturation (programs/s "
                         "completed when all arrive at once, simulated with the calibrated step costs of "
                         "`agentrt simulate --calibrate`), e.g. 0.9 (the default when --rate is not given)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="fcfs,mlfq,plas,atlas",
                    help="comma-separated NAME[:np][:KEY=VALUE...], e.g. fcfs,plas,plas:beta=2,atlas:np")
    ap.add_argument("--max-num-seqs", type=int, default=ENGINE["max_num_seqs"])
    ap.add_argument("--max-num-batched-tokens", type=int, default=ENGINE["max_num_batched_tokens"])
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="the engine's KV cache in blocks of 16 tokens (default: the engine's): a memory-bound engine")
    ap.add_argument("--kv-host-gib", type=float, default=None,
                    help="KV tier T1 below the cache, GiB of host memory (default: none; the simulator models a CPU "
                         "engine's, read in place)")
    ap.add_argument("--first-boundary", type=float, default=None, help="plas/atlas: override the default (s)")
    ap.add_argument("--quantum", type=float, default=None, help="plas/atlas/mlfq: override the default (s)")
    ap.add_argument("--beta", type=float, default=None, help="plas/atlas: override the default")
    ap.add_argument("--tree", default=None, metavar="WIDTHxDEPTH",
                    help=f"tree programs: parallel calls per round x rounds (default {TREE['width']}x{TREE['depth']})")
    ap.add_argument("--react-calls", default=None, metavar="N|LO-HI",
                    help="calls per ReAct program, fixed or uniform in a range "
                         f"(default {REACT['calls'][0]}-{REACT['calls'][1]})")
    ap.add_argument("--mix", default=None, metavar="KIND=WEIGHT,...",
                    help="program kinds and their weights, e.g. chat=0.7,react=0.2,tree=0.1 (default "
                         + ",".join(f"{k}={v:g}" for k, v in wl.MIX.items()) + ")")
    ap.add_argument("--step-tokens", type=int, default=None,
                    help=f"output tokens per ReAct / tree call (default {REACT['max_tokens']})")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")


def apply_workload_options(args: argparse.Namespace) -> None:
    """--tree, --react-calls, --step-tokens and --mix applied to agentrt/bench/workload.py's tables (None: unchanged);
    a malformed value ends the command, naming it."""
    if args.tree is not None:
        try:
            TREE["width"], TREE["depth"] = (int(x) for x in args.tree.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--tree must be WIDTHxDEPTH such as 4x4, got {args.tree!r}") from None
    if args.react_calls is not None:
        try:
            lo, sep, hi = str(args.react_calls).partition("-")
            calls = (int(lo), int(hi) if sep else int(lo))
            if not 1 <= calls[0] <= calls[1]:
                raise ValueError
        except ValueError:
            raise SystemExit(f"--react-calls must be N or LO-HI with 1 <= LO <= HI, such as 4 or 2-10, "
                             f"got {args.react_calls!r}") from None
        REACT["calls"] = calls
    if getattr(args, "step_tokens", None) is not None:
        REACT["max_tokens"] = TREE["max_tokens"] = args.step_tokens
    if args.mix is not None:
        try:
            mix = {k.strip(): float(w) for k, _, w in (item.partition("=") for item in args.mix.split(","))}
            if not mix or set(mix) - set(wl.PLANS) or min(mix.values()) < 0 or sum(mix.values()) <= 0:
                raise ValueError
        except ValueError:
            raise SystemExit(f"--mix must be KIND=WEIGHT pairs of {', '.join(wl.PLANS)} with weights >= 0, such as "
                             f"chat=0.7,react=0.2,tree=0.1, got {args.mix!r}") from None
        wl.MIX.clear()
        wl.MIX.update(mix)


def setup(args: argparse.Namespace, cost: Any = None,
          saturation: Callable[[list[ProgramSpec], dict[str, Any]], float] | None = None,
          ) -> tuple[list[ProgramSpec], dict[str, Any]]:
    """Apply the workload options; the workload and the engine settings they name. With --load, the rate is
    that fraction of the saturation rate: `saturation(workload, engine)` programs/s when given (--http: measured
    on the server), else simulated with `cost` (default: this machine's calibrated fit)."""
    if args.rate is not None and args.load is not None:
        raise SystemExit("give --rate or --load, not both")
    if args.rate is None and args.load is None:
        args.load = 0.9
    if args.rate is not None and not (isinstance(args.rate, float) and 0 < args.rate < float("inf")):
        raise SystemExit(f"--rate must be a number of program arrivals per second > 0, got {args.rate!r}")
    if args.programs < 1:
        raise SystemExit(f"--programs must be >= 1, got {args.programs!r}")
    for entry in args.policies.split(","):
        policy_spec(entry, args)  # unknown names and variants fail here, before anything runs
    apply_workload_options(args)
    engine = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    for key in ("num_blocks", "kv_host_gib"):  # a memory-bound engine, and the host tier below it
        if getattr(args, key, None) is not None:
            engine[key] = getattr(args, key)
    args.capacity_programs_per_s = None
    if args.load is not None:
        if not (isinstance(args.load, float) and 0 < args.load < float("inf")):
            raise SystemExit(f"--load must be a fraction of saturation > 0 such as 0.9, got {args.load!r}")
        if saturation is not None:
            cap = saturation(make_workload(args.programs, 1.0, args.seed), engine)
        else:
            from agentrt.bench import costs
            from agentrt.bench.sim_run import capacity

            if cost is None:
                cost, line = costs.for_this_machine(getattr(args, "model", None), quiet=True)
                print(f"agentrt bench programs: {line}", file=sys.stderr)
            cap = capacity(make_workload(args.programs, 1.0, args.seed), engine=engine, cost=cost)
        args.capacity_programs_per_s = cap
        args.rate = args.load * cap
        print(f"load {args.load:.2f} of saturation {cap:.3f} programs/s: arrival rate {args.rate:.3f} programs/s",
              file=sys.stderr)
    return make_workload(args.programs, args.rate, args.seed), engine


def new_report(args: argparse.Namespace, engine: dict[str, Any]) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_implementation()} {platform.python_version()}",
        "config": {"mix": dict(wl.MIX), "tree": f"{TREE['width']}x{TREE['depth']}", "react_calls": "{}-{}".format(*REACT["calls"]), "step_tokens": REACT["max_tokens"],
                   "first_boundary": args.first_boundary, "quantum": args.quantum, "beta": args.beta,
                   "programs": args.programs, "rate": args.rate, "seed": args.seed,
                   "seeds": getattr(args, "seeds", 1), "engine": engine,
                   "load": args.load, "capacity_programs_per_s": getattr(args, "capacity_programs_per_s", None),
                   "model": getattr(args, "model", None), "http": bool(getattr(args, "http", False))},
        "results": {},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench programs", description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--model", default=None, help="model path; default: the default model")
    ap.add_argument("--docs", type=Path, nargs="?", const=_common.page("programs"), default=None, metavar="PATH",
                    help="write the tables to docs/benchmarks/programs.md (or PATH), newest run first")
    ap.add_argument("--http", action="store_true",
                    help="the same programs through a fresh `agentrt serve` per policy, over HTTP (agentrt/bench/programs_http.py)")
    ap.add_argument("--timeline", default=None, metavar="PNG", help="--http: plot every call of the run here")
    ap.add_argument("--breakdown", action="store_true",
                    help="in-process runs: split each program's time into queueing, its own compute, the batch's width, "
                         "others' prefill and the rest, from every step (agentrt/bench/breakdown.py)")
    ap.add_argument("--seeds", type=int, default=1,
                    help="workloads of seeds --seed .. --seed + N - 1 at the same arrival rate, every policy on each; "
                         "statistics over all their programs pooled, makespan averaged")
    ap.add_argument("--calibrate", action="store_true",
                    help="--http: fit this machine's step costs anew right after the served runs (and store the fit), "
                         "so the simulator beside them prices steps as the machine ran them that hour")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be >= 1, got {args.seeds!r}")
    if args.calibrate and not args.http:
        raise SystemExit("--calibrate goes with --http (the simulated side-by-side of a served run)")
    model = str(resolve_model(args.model))  # a path that is not a model fails first, in one line
    measured: dict[str, Any] = {}

    def measure(work: list[ProgramSpec], engine: dict[str, Any]) -> float:
        from agentrt.bench import programs_http

        measured.update(programs_http.measure_saturation(work, model, engine, args.seed))
        curve = ", ".join(f"{n}: {c['output_tok_s']:.0f} ({c['calls_waiting']:.1f} waiting)"
                          for n, c in measured["curve"].items())
        print(f"measured saturation: {measured['output_tok_s']:.0f} output tok/s with {measured['in_flight']} programs "
              f"in flight (output tok/s by programs in flight: {curve}), {measured['tokens_per_program']:.0f} tokens "
              "a program", file=sys.stderr)
        return measured["programs_per_s"]

    workload, engine = setup(args, saturation=measure if args.http else None)
    seeds = list(range(args.seed, args.seed + args.seeds))
    workloads = [workload] + [make_workload(args.programs, args.rate, seed) for seed in seeds[1:]]
    if args.timeline and not args.http:
        raise SystemExit("--timeline needs --http")
    if args.breakdown and args.http:
        raise SystemExit("--breakdown runs in-process (it reads every engine step): drop --http")
    cost = None
    if args.breakdown:
        from agentrt.bench import costs

        cost, line = costs.for_this_machine(args.model, quiet=True)
        print(f"--breakdown: {line}", file=sys.stderr)
    if args.http:
        from agentrt.bench import programs_http

        for policy in args.policies.split(","):  # a knob the server does not take fails before anything runs
            programs_http.serve_args(*policy_spec(policy, args))
    report = new_report(args, engine)
    if measured:
        report["config"]["saturation"] = measured
    policies = args.policies.split(",")
    runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
    for seed, work in zip(seeds, workloads):  # seed by seed, every policy in turn: a drift of the machine's speed
        for policy in policies:              # over the run then falls on every policy alike
            t0 = time.monotonic()
            name, kwargs = policy_spec(policy, args)
            if args.http:
                runs[policy].append(programs_http.run_policy_http(name, kwargs, work, model, engine))
            else:
                runs[policy].append(anyio.run(run_policy, name, work, args.model, engine, kwargs, cost))
            res = runs[policy][-1]
            print(f"{policy}{f' seed {seed}' if len(seeds) > 1 else ''}: mean "
                  f"{statistics.fmean(p['latency_s'] for p in res['programs']):.2f} s, makespan {res['makespan_s']:.1f} s, "
                  f"done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    for policy in policies:
        report["results"][policy] = summarize(pool(runs[policy]))
        if args.http:
            report["results"][policy]["http_breakdown"] = programs_http.breakdown(
                report["results"][policy]["programs"], LONG_KINDS)
    add_ratios(report)
    if args.http and args.kv_host_gib is None:
        if args.calibrate:
            from agentrt.bench import calibrate, costs

            fit, _ = calibrate.calibrate(args.model)
            costs.store(fit)
            print(calibrate.describe(fit), file=sys.stderr)
        report["simulated"] = simulated(report, policies, workloads, engine, args)
    if args.timeline:
        programs_http.plot_timeline(report, args.timeline)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"arrival rate {args.rate:.3f} programs/s{load_note(report['config'])}")
        print(table(report))
        for name, r in report["results"].items():
            vs = r.get("vs_fcfs", {})
            print(f"{name}: short programs mean {r['by_class']['short'].get('mean', float('nan')):.2f} s "
                  f"({vs.get('short.mean', float('nan')):.2f}x fcfs), long programs mean "
                  f"{r['by_class']['long'].get('mean', float('nan')):.2f} s ({vs.get('long.mean', float('nan')):.2f}x), "
                  f"long p99 {vs.get('long.p99', float('nan')):.2f}x, time for all {vs.get('makespan', float('nan')):.2f}x")
    if args.http and not args.json:
        print("\nWhere the time goes (mean per program; from the server's program records and /metrics samples):")
        print(programs_http.breakdown_table(report["results"]))
        if "simulated" in report:
            print(f"\n{SIM_NOTE}\n\n{simulated_table(report)}")
            if "simulated_knee" in report:
                print(f"\n{knee_line(report)}")
    if args.breakdown and not args.json:
        from agentrt.bench import breakdown as bd

        print("\nWhere the time goes (mean per program, seconds; parts summed over its calls):")
        print(bd.table(report["results"]))
    if args.docs is not None:
        write_docs(report, args.docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
