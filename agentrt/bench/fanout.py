"""The fan-out case: short programs arriving while tree searches fan out, in-process, every policy in one run.

    agentrt bench fanout [--trees 2] [--width 6] [--rounds 3] [--tree-tokens 24] [--shorts 6] [--short-tokens 8]
                         [--max-num-seqs 4] [--policies fcfs,mlfq,plas,atlas,plas+ttl] [--repeats 1]
                         [--model M] [--json] [--docs]

Tree programs start together, each making `--rounds` rounds of `--width` parallel calls of `--tree-tokens`
output tokens (a round waits for the previous one, as an MCTS expansion does), on an engine with
`--max-num-seqs` seats: the trees alone fill every seat. When the first tree starts its second round,
`--shorts` one-call programs of `--short-tokens` tokens arrive. A program-level policy should serve them
ahead of the trees' later calls (they have received nothing, the trees a whole round); FCFS serves them
after the round's calls that came first. Reported per policy: the short programs' mean and max latency
(arrival to end) and mean queueing (arrival to first step), the trees' mean latency and the makespan, and
the short mean against FCFS's in the same run. Outputs ignore EOS, so every policy does the same work.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

import anyio

import agentrt
from agentrt.policies import POLICY_NAMES


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


async def run_one(policy: str, args: argparse.Namespace, policy_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One policy on the fan-out case; latencies in seconds."""
    rng = random.Random(args.seed)
    tree_prompts = [[[_prompt(rng, 16) for _ in range(args.width)] for _ in range(args.rounds)] for _ in range(args.trees)]
    short_prompts = [_prompt(rng, 16) for _ in range(args.shorts)]
    engine = {"max_num_seqs": args.max_num_seqs, **(args.engine or {})}
    async with agentrt.Runtime(args.model, policy=policy, policy_kwargs=policy_kwargs, **engine) as rt:
        await agentrt.generate(_prompt(rng, 16), max_tokens=2)  # warm-up, not measured
        second_round = anyio.Event()
        trees: list[float] = []
        shorts: list[dict[str, float]] = []
        start = time.monotonic()

        async def call(prompt: list[int], n: int) -> Any:
            return await agentrt.generate(prompt, max_tokens=n, ignore_eos=True, temperature=0.0, full=True)

        @agentrt.program(name="tree")
        async def tree(rounds: list[list[list[int]]]) -> None:
            for i, prompts in enumerate(rounds):
                if i == 1:
                    second_round.set()
                await agentrt.gather(*(call(p, args.tree_tokens) for p in prompts))
            trees.append(time.monotonic() - start)

        @agentrt.program(name="short")
        async def short(prompt: list[int]) -> None:
            t0 = time.monotonic()
            await call(prompt, args.short_tokens)
            shorts.append({"latency_s": time.monotonic() - t0, "program_id": agentrt.current_program_id()})

        async def shorts_when_trees_fan_out() -> None:
            await second_round.wait()
            async with anyio.create_task_group() as tg:
                for p in short_prompts:
                    tg.start_soon(short, p)

        async with anyio.create_task_group() as tg:
            for prompts in tree_prompts:
                tg.start_soon(tree, prompts)
            tg.start_soon(shorts_when_trees_fan_out)
        makespan = time.monotonic() - start
        kv = rt.kv_stats()
        queued = [rt.programs[s["program_id"]].wait_s for s in shorts]
    return {
        "policy": policy,
        "short_mean_s": statistics.fmean(s["latency_s"] for s in shorts),
        "short_max_s": max(s["latency_s"] for s in shorts),
        "short_queued_s": statistics.fmean(queued),  # arrival to first step: the contention the case assumes
        "tree_mean_s": statistics.fmean(trees),
        "makespan_s": makespan,
        "preemptions": kv.num_preemptions,
        "programs_done": len(shorts) + len(trees),
        "programs": args.shorts + args.trees,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every policy, `--repeats` times interleaved (a drift of the machine falls on all alike); means of the
    repeats, each policy's short mean against FCFS's."""
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in args.policies}
    for _ in range(args.repeats):
        for policy in args.policies:
            runs[policy].append(anyio.run(run_one, policy, args, args.policy_kwargs.get(policy)))
    results = {}
    for policy, rs in runs.items():
        results[policy] = {k: (statistics.fmean(r[k] for r in rs) if isinstance(rs[0][k], float) else rs[0][k])
                           for k in rs[0]}
        results[policy]["programs_done"] = min(r["programs_done"] for r in rs)
        results[policy]["preemptions"] = sum(r["preemptions"] for r in rs)
    base = results.get("fcfs")
    for r in results.values():
        r["short_vs_fcfs"] = r["short_mean_s"] / base["short_mean_s"] if base else float("nan")
    return {"config": {k: v for k, v in vars(args).items() if k not in ("policies", "policy_kwargs")} | {
        "policies": list(args.policies)}, "results": results}


def table(report: dict[str, Any]) -> str:
    lines = ["| policy | short mean s | short max s | short queued s | short vs fcfs | tree mean s | makespan s "
             "| preemptions | done |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["results"].items():
        lines.append(f"| {name} | {r['short_mean_s']:.2f} | {r['short_max_s']:.2f} | {r['short_queued_s']:.2f} "
                     f"| {r['short_vs_fcfs']:.2f}x "
                     f"| {r['tree_mean_s']:.2f} | {r['makespan_s']:.2f} | {r['preemptions']} "
                     f"| {r['programs_done']}/{r['programs']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="agentrt bench fanout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", type=int, default=2)
    ap.add_argument("--width", type=int, default=6, help="parallel calls per tree round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tree-tokens", type=int, default=24)
    ap.add_argument("--shorts", type=int, default=6, help="one-call programs arriving at the trees' second round")
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--policies", default="fcfs,mlfq,plas,atlas,plas+ttl")
    ap.add_argument("--policy-kwargs", default="{}", metavar="JSON",
                    help='per policy, its arguments: {"plas": {"first_boundary": 0.1}}')
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--docs", action="store_true", help='write the table to docs/benchmarks/fanout.md ("The fan-out case")')
    args = ap.parse_args(argv)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in args.policies:
        if p not in POLICY_NAMES:
            ap.error(f"--policies: unknown policy {p!r} (choose from {', '.join(POLICY_NAMES)})")
    try:
        args.policy_kwargs = json.loads(args.policy_kwargs)
        if not isinstance(args.policy_kwargs, dict):
            raise ValueError
    except ValueError:
        ap.error(f"--policy-kwargs must be a JSON object of policy name -> arguments, got {args.policy_kwargs!r}")
    for name in ("trees", "width", "rounds", "tree_tokens", "shorts", "short_tokens", "max_num_seqs", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.rounds < 2:
        ap.error(f"--rounds must be >= 2 (the short programs arrive at the second), got {args.rounds}")
    args.engine = None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(table(report))
    if args.docs:
        from agentrt.bench import _common

        _common.write_section("The fan-out case (bench fanout)", table(report) + "\n\nShort-program latency is arrival to "
                              "end, `short queued` arrival to first step (the process table's wait); means of the repeats.")
    if any(r["programs_done"] < r["programs"] for r in report["results"].values()):
        print("agentrt bench fanout: some programs did not finish", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
