"""Replicas on Ray Serve: each router over the same agent workload, real engines, one run.

    agentrt bench replicas [--replicas 2] [--routers single,program,pow2,round-robin,prefix]
                           [--agent react|small] [--turns LO-HI] [--programs 16] [--rate 1.0]
                           [--seeds 0,1,2] [--num-blocks N] [--router-kwargs JSON] [--json] [--write-docs]

For each router: a local Ray instance (logical CPUs = replicas, one torch thread per replica, no
dashboard) serves `--replicas` replicas of the default model behind agentrt's front
(agentrt.scale.ray_app), and the same agents (agentrt/bench/workload.py's `agent_plan`: a shared system prompt,
a task, 4-6 turns of call then tool, log-normal tool times; `--agent react` = REACT_SMALL, ReAct's ~20
prompt tokens per output token with tool observations growing the context, or `small` = AGENT_SMALL,
short contexts) arrive as a Poisson process, the same for every router of a seed. Each agent's calls carry its program id (`X-Program-Id`) and feed the generated token ids into
the next prompt, over `/v1/completions` with token-id prompts (greedy, EOS ignored: every router does
the same work). `single` is one replica (one engine, two threads): the prefix hits an engine that
holds every program gets.

Reported per router: later-turn prefix hit rate (of calls after a program's first, the share of prompt
tokens served from the prefix cache: `usage.prompt_tokens_details.cached_tokens`), its ratio to
`single`, the share of later calls that ran on the replica their program's previous call ran on (where
its context is: round-robin's falls toward 1/N), program latency mean and p95 (arrival -> last call's
end, tool time included), calls per replica, calls running per replica (time-averaged) and the load
skew, and the ratios of the program router's mean latency to the others'. With several `--seeds`
each router runs every seed and its row pools them (every program's latency, every later call).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import time
from typing import Any

import anyio
import httpx

from agentrt.bench import _common
from agentrt.bench import workload as wl
from agentrt.bench.serve import free_port
from agentrt.bench.workload import AGENT_SMALL, REACT_SMALL, Call

ROUTER_NAMES = ("single", "program", "pow2", "round-robin", "prefix")
AGENTS = {"react": ("REACT_SMALL", REACT_SMALL), "small": ("AGENT_SMALL", AGENT_SMALL)}  # --agent: (name, sizes)


async def _agent(client: httpx.AsyncClient, pid: str, plan: Any, delay: float, calls: list[dict[str, Any]],
                 latencies: list[float]) -> None:
    await anyio.sleep(delay)
    t0 = time.monotonic()
    step = next(plan)
    turn = 0
    while True:
        if isinstance(step, Call):
            body = {"model": "m", "prompt": step.prompt, "max_tokens": step.max_tokens, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            sent = time.monotonic()
            r = await client.post("/v1/completions", json=body, headers={"X-Program-Id": pid})
            if r.status_code != 200:
                raise RuntimeError(f"program {pid} turn {turn}: {r.status_code} {r.text[:300]}")
            out = r.json()
            usage = out["usage"]
            calls.append({"program": pid, "turn": turn, "replica": r.headers.get("x-agentrt-replica", "?"),
                          "prompt": usage["prompt_tokens"], "start": sent, "end": time.monotonic(),
                          "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0})
            turn += 1
            reply = out["choices"][0]["token_ids"]
        else:  # a tool: its time, then its observation joins the context
            await anyio.sleep(step.seconds)
            reply = step.observation
        try:
            step = plan.send(reply)
        except StopIteration:
            break
    latencies.append(time.monotonic() - t0)


def _size(args: argparse.Namespace) -> dict[str, Any]:
    size = AGENTS[args.agent][1]
    return {**size, "turns": args.turns} if getattr(args, "turns", None) else size


def _plans(args: argparse.Namespace, vocab: int) -> list[tuple[str, Any, float]]:
    rng = random.Random(args.seed)
    size = _size(args)
    system = [rng.randrange(100, vocab) for _ in range(size["system"])]
    out, t = [], 0.0
    for i in range(args.programs):
        t += rng.expovariate(args.rate)
        prng = random.Random(rng.randrange(1 << 30))
        fresh = lambda n, prng=prng: [prng.randrange(100, vocab) for _ in range(n)]
        out.append((f"agent-{args.seed}-{i}", wl.agent_plan(prng, size, fresh, system), t))
    return out


def run_router(args: argparse.Namespace, router: str, model: str) -> dict[str, Any]:
    import logging

    import ray
    from ray import serve

    logging.getLogger("httpx").setLevel(logging.WARNING)  # Ray's logging set-up would print every request

    from agentrt.scale.ray_app import build_app, init_local_ray
    from agentrt.server import ServerConfig

    replicas = 1 if router == "single" else args.replicas
    threads = args.replicas if router == "single" else 1
    port = free_port()
    blocks = args.num_blocks * (args.replicas // replicas) if args.num_blocks else None  # single: all the KV
    config = ServerConfig(model=model, served_model_name="m", db="none",
                          engine={"num_blocks": blocks} if blocks else {})
    init_local_ray(max(replicas, 1), configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        kwargs = args.router_kwargs if router == "program" else None
        serve.run(build_app(config, replicas, "program" if router == "single" else router, num_cpus=1,
                            torch_threads=threads, router_kwargs=kwargs), name="agentrt", route_prefix="/")
        calls: list[dict[str, Any]] = []
        latencies: list[float] = []

        async def main() -> None:
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as client:
                warm = await client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 1})
                warm.raise_for_status()
                async with anyio.create_task_group() as tg:
                    for pid, plan, delay in _plans(args, args.vocab):
                        tg.start_soon(_agent, client, pid, plan, delay, calls, latencies)

        t0 = time.monotonic()
        anyio.run(main)
        wall = time.monotonic() - t0
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    later = [c for c in calls if c["turn"] > 0]
    busy = _busy(calls, replicas)
    return {
        "router": router, "replicas": replicas, "seed": args.seed, "latencies": latencies, "wall_s": wall,
        "later_cached": sum(c["cached"] for c in later), "later_prompt": sum(c["prompt"] for c in later),
        "per_replica": sorted([*collections.Counter(c["replica"] for c in calls).values(),
                               *[0] * (replicas - len({c["replica"] for c in calls}))], reverse=True),
        "skew": busy.pop("skew"), "calls_running": sorted(busy.values(), reverse=True),
        "programs_split": sum(1 for p in {c["program"] for c in calls}
                              if len({c["replica"] for c in calls if c["program"] == p}) > 1),
        "later_calls": len(later), "later_same": _same_replica(calls),
    }


def _same_replica(calls: list[dict[str, Any]]) -> int:
    """Later calls that ran on the replica their program's previous call ran on (where its context is)."""
    last: dict[str, str] = {}  # program -> the replica of its latest call so far
    same = 0
    for c in sorted(calls, key=lambda c: (c["program"], c["turn"])):
        same += last.get(c["program"]) == c["replica"]
        last[c["program"]] = c["replica"]
    return same


def _busy(calls: list[dict[str, Any]], n: int) -> dict[str, float]:
    """Per replica, its calls running averaged over the time any call ran (from the client's view: sent ->
    answered), and "skew": the time-averaged |difference| between the busiest and the idlest replica's calls
    running, the load imbalance a router left (0: always even). `n`: the replicas (one sent no call counts as 0)."""
    if not calls:
        return {"skew": 0.0}
    replicas = sorted({c["replica"] for c in calls})
    replicas += [f"(idle {i})" for i in range(n - len(replicas))]
    events = sorted([(c["start"], 1, c["replica"]) for c in calls] + [(c["end"], -1, c["replica"]) for c in calls])
    running = dict.fromkeys(replicas, 0)
    area = dict.fromkeys(replicas, 0.0)
    skew = span = 0.0
    last = events[0][0]
    for t, delta, replica in events:
        dt = t - last
        if any(running.values()):
            span += dt
            for r in replicas:
                area[r] += running[r] * dt
            skew += (max(running.values()) - min(running.values())) * dt
        running[replica] += delta
        last = t
    out = {r: a / span for r, a in area.items()} if span else dict.fromkeys(replicas, 0.0)
    out["skew"] = skew / span if span else 0.0
    return out


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One router's runs over several seeds as one row: every program's latency and every later call pooled,
    calls per replica summed rank by rank (busiest replica of each run first)."""
    lat = sorted(x for r in runs for x in r["latencies"])
    width = max(len(r["per_replica"]) for r in runs)
    return {
        "router": runs[0]["router"], "replicas": runs[0]["replicas"], "seeds": [r["seed"] for r in runs],
        "programs": len(lat), "calls": sum(sum(r["per_replica"]) for r in runs),
        "later_hit_rate": sum(r["later_cached"] for r in runs) / max(1, sum(r["later_prompt"] for r in runs)),
        "mean_s": statistics.mean(lat), "p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))],
        "per_seed_mean_s": [statistics.mean(r["latencies"]) for r in runs],
        "per_replica": [sum(r["per_replica"][i] for r in runs if i < len(r["per_replica"])) for i in range(width)],
        "programs_split": sum(r["programs_split"] for r in runs), "wall_s": sum(r["wall_s"] for r in runs),
        "calls_running": [statistics.mean(r["calls_running"][i] for r in runs if i < len(r["calls_running"]))
                          for i in range(max(len(r["calls_running"]) for r in runs))],
        "skew": statistics.mean(r["skew"] for r in runs),
        "same_replica": sum(r.get("later_same", 0) for r in runs) / max(1, sum(r.get("later_calls", 0) for r in runs)),
    }


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    by = {r["router"]: r for r in rows}
    single = by.get("single")
    table = []
    for r in rows:
        base = single["later_hit_rate"] if single else 0.0
        vs_single = f"{r['later_hit_rate'] / base:.2f}x" if base else "-"
        table.append([r["router"], r["replicas"], r["calls"], f"{100 * r['later_hit_rate']:.1f}%", vs_single,
                      f"{100 * r['same_replica']:.0f}%",
                      f"{r['mean_s']:.2f}", f"{r['p95_s']:.2f}", " / ".join(map(str, r["per_replica"])),
                      " / ".join(f"{x:.1f}" for x in r["calls_running"]), f"{r['skew']:.2f}",
                      r["programs_split"], f"{r['wall_s']:.0f}"])
    lines = [_common.markdown_table(["router", "replicas", "calls", "later-turn prefix hits", "vs single",
                                     "later calls on the previous call's replica", "program mean s", "program p95 s", "calls per replica",
                                     "calls running per replica", "load skew", "programs split over replicas",
                                     "wall s"], table),
             ("Calls running per replica: time-averaged over the time any call ran; load skew: the time-averaged "
              "difference between the busiest and the idlest replica's calls running.")]
    prog = by.get("program")
    if prog:
        ratios = [f"{name} {prog['mean_s'] / by[name]['mean_s']:.2f}x" for name in ("pow2", "round-robin", "prefix")
                  if name in by]
        if ratios:
            lines.append(f"Program router mean program latency (pooled over seeds {prog['seeds']}) vs: "
                         f"{', '.join(ratios)} (targets: <= 0.75x pow2, <= 0.9x prefix).")
        for name in ("pow2", "prefix"):
            if name in by and len(prog["seeds"]) > 1:
                each = ", ".join(f"{a / b:.2f}x" for a, b in zip(prog["per_seed_mean_s"], by[name]["per_seed_mean_s"]))
                lines.append(f"Per seed, program vs {name}: {each}.")
        if single and single["later_hit_rate"]:
            share = prog["later_hit_rate"] / single["later_hit_rate"]
            lines.append(f"Program router later-turn prefix hits: {share:.2f}x of one engine's (target >= 0.95x).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="agentrt bench replicas", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--routers", default=",".join(ROUTER_NAMES), help=f"comma-separated: {', '.join(ROUTER_NAMES)}")
    ap.add_argument("--agent", choices=sorted(AGENTS), default="react",
                    help="agent shape (agentrt/bench/workload.py): react = REACT_SMALL, ~20 prompt tokens per output token "
                         "and a context growing by tool observations (default); small = AGENT_SMALL, short contexts")
    ap.add_argument("--turns", default=None, metavar="LO-HI",
                    help="calls per agent, uniform in LO-HI (default: the agent shape's, 4-6; Autellix's ReAct "
                         "programs make ~10.8 calls)")
    ap.add_argument("--programs", type=int, default=16)
    ap.add_argument("--rate", type=float, default=1.0, help="programs per second (Poisson)")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV blocks of 16 tokens per replica (`single`: all replicas' blocks; default: the CPU default "
                         "pool, ~1 GiB, which holds every context here; a smaller pool is a KV-bound replica, as "
                         "on a GPU)")
    ap.add_argument("--router-kwargs", default=None, metavar="JSON",
                    help="the program router's RouterConfig fields as a JSON object, e.g. '{\"max_load\": 4}'")
    ap.add_argument("--seeds", default="0", help="comma-separated workload seeds; each router runs each, pooled")
    ap.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    ap.add_argument("--write-docs", action="store_true", help="write the table to docs/benchmarks/replicas.md")
    args = ap.parse_args(argv)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    bad = [r for r in routers if r not in ROUTER_NAMES]
    if bad:
        ap.error(f"unknown router {bad[0]!r}; expected some of {', '.join(ROUTER_NAMES)}")
    if args.num_blocks is not None and args.num_blocks < 64:
        ap.error(f"--num-blocks {args.num_blocks} is too small: at least 64 (a context of 1,024 tokens)")
    if args.replicas < 1 or args.programs < 1 or args.rate <= 0:
        ap.error("--replicas and --programs must be >= 1 and --rate > 0")
    if args.turns is not None:
        lo, _, hi = args.turns.partition("-")
        try:
            args.turns = (int(lo), int(hi or lo))
        except ValueError:
            ap.error(f"--turns {args.turns!r} must be N or LO-HI, e.g. 8-12")
        if not 1 <= args.turns[0] <= args.turns[1]:
            ap.error(f"--turns {lo}-{hi or lo}: needs 1 <= LO <= HI")
    if args.router_kwargs is not None:
        from agentrt.scale.router import RouterConfig

        try:
            args.router_kwargs = json.loads(args.router_kwargs)
            RouterConfig(**args.router_kwargs)
        except (ValueError, TypeError) as e:
            ap.error(f"--router-kwargs {args.router_kwargs!r}: {e}")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r} must be comma-separated integers")
    if not seeds:
        ap.error("--seeds names no seed")
    try:
        import ray  # noqa: F401
    except ImportError:
        ap.error("needs Ray Serve: pip install 'agentrt[ray]'")
    from agentrt.engine.loader import resolve_model

    model = str(resolve_model(args.model))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    for router in routers:
        runs = []
        for seed in seeds:
            args.seed = seed
            runs.append(run_router(args, router, model))
        row = pooled(runs)
        print(f"{router}: later-turn hits {100 * row['later_hit_rate']:.1f}%, program mean {row['mean_s']:.2f} s "
              f"(per seed {', '.join(f'{m:.2f}' for m in row['per_seed_mean_s'])}), p95 {row['p95_s']:.2f} s, "
              f"calls per replica {row['per_replica']}", flush=True)
        rows.append(row)
    text = (f"Run {started}. {_common.machine()}. {_common.cpu_flags_line()}\n\n"
            f"`{_common.command()}`: {args.programs} agents ({args.agent}: {AGENTS[args.agent][0]}, "
            f"{_size(args)['turns'][0]}-{_size(args)['turns'][1]} calls each) at "
            f"{args.rate}/s per seed, seeds {args.seeds}, "
            f"KV pool {f'{args.num_blocks} blocks of 16 tokens' if args.num_blocks else 'the CPU default'} per replica, "
            f"{args.replicas} replicas with one torch thread each (`single`: one replica, {args.replicas} threads), "
            "default model, greedy, EOS ignored.\n\n" + report(rows, args))
    print(text)
    if args.json:
        print(json.dumps(rows, indent=1))
    if args.write_docs:
        _common.write_section("Replicas on Ray Serve (bench replicas)", text)


if __name__ == "__main__":
    main()
