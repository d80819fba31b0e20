"""KV retention benchmark on the real engine: agents under memory pressure, every mode in one run.

    agentrt bench retention [--programs N] [--rate R] [--num-blocks B] [--policies fcfs,plas]
                            [--modes nocache,lru,lru+admission,ttl,ttl+reserve]
                            [--task-tokens N] [--tool-median-s S] [--json] [--write-docs]

Agents follow `agentrt/bench/workload.py`'s `agent_plan` at `AGENT_SMALL` size (ReAct / coding-agent shapes
scaled to a 2-core CPU: a shared system prompt, a task, 4-6 turns of call then tool, log-normal tool
times with a heavy tail). The KV cache (`--num-blocks`) holds only part of the active programs'
contexts, so what survives a tool call depends on the mode:

- nocache: no prefix cache at all;
- lru: the prefix cache, plain LRU (vLLM-like);
- lru+admission: lru under the policy arguments of the TTL modes (below), no pins: what the admission
  control does alone;
- ttl: programs' KV pinned across tool calls for Continuum's TTL (agentrt._retention);
- ttl+reserve: ttl, and every program's observed context reserved (auto_reserve).

With pins (ttl, ttl+reserve) each policy runs as composed with TTL (`TTL_POLICY`): fcfs in Continuum's
order (calls of programs holding a pin first) with agentrt's admission control (`FCFS(pinned_first=True,
protect_pins=True)`: a call goes in only if it fits whole, and only a program holding a pin may make
other programs' pins give way), plas as `PLAS(**TTL_SETTINGS)` (agentrt/policies/autellix.py: the same
two, no displacement, newest victims). `agentrt simulate agents` also runs Continuum's order without
the admission control (`fcfs+ttl`).

Default size: 16 agents at 2 programs/s, a 600-token task and tools of median 0.15 s (published agent
traces: median tool latency 0.1-0.6 s), in a 160-block (2,560-token) cache: a 600-token prefill takes
~0.4 s on a 2-core CPU, so, as for a GPU agent with tens of thousands of tokens of context, recomputing
a context costs more than most tool calls last, the regime in which retention matters.

Programs are driven by id, as the server drives them (`Runtime.start_program / submit / end_program`;
the tool's name is told with `Runtime.tool_started`), feeding each call's generated token ids into the
next prompt. Outputs ignore EOS, so every mode does the same work. Reported per (policy, mode):
recomputed prefill tokens (prompt tokens a program had computed in its previous call, computed again),
prefix hit rate, program latency mean and p95, and ratios to lru under the same policy.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio

import agentrt
from agentrt._retention import RetentionConfig
from agentrt.bench import _common
from agentrt.bench import workload as wl
from agentrt.bench.workload import AGENT_SMALL, Call, ProgramSpec
from agentrt.engine import RequestOutput, SamplingParams
from agentrt.policies.autellix import TTL_SETTINGS

MODES = {
    "nocache": {"enable_prefix_caching": False, "retention": RetentionConfig(ttl=False)},
    "lru": {"retention": RetentionConfig(ttl=False)},
    "lru+admission": {"retention": RetentionConfig(ttl=False)},  # ablation: the TTL modes' policy arguments, no pins
    "ttl": {"retention": RetentionConfig()},
    "ttl+reserve": {"retention": RetentionConfig(auto_reserve=True)},
}
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 256}
COMPOSED = {"lru+admission", "ttl", "ttl+reserve"}  # modes whose policies run with TTL_POLICY's arguments
TTL_POLICY: dict[str, dict[str, Any]] = {  # policy -> its arguments when programs' KV is pinned across tool calls
    "fcfs": {"pinned_first": True, "protect_pins": True},  # Continuum's order, with our admission control
    "plas": dict(TTL_SETTINGS),  # ours
}
_PREFIX = wl.tokens(random.Random(99), AGENT_SMALL["system"])
SIZE = {**AGENT_SMALL, "task": 600, "tool_median_s": 0.15}  # see the module docstring


def workload(n: int, rate: float, seed: int) -> list[ProgramSpec]:
    rng = random.Random(seed)
    t, specs = 0.0, []
    for i in range(n):
        specs.append(ProgramSpec(i, "agent", t, rng.randrange(1 << 30)))
        t += rng.expovariate(rate)
    return specs


async def _program(rt: agentrt.Runtime, spec: ProgramSpec, start: float, size: dict[str, Any],
                   on_call: Callable[[RequestOutput], None] | None = None) -> dict[str, Any]:
    await anyio.sleep(max(0.0, start + spec.arrival_s - time.monotonic()))
    rng = random.Random(spec.seed)
    gen = wl.agent_plan(rng, size, lambda k: wl.tokens(rng, k), _PREFIX)
    info = rt.start_program(name="agent")
    pid, value, action = info.program_id, None, None
    try:
        action = gen.send(None)
        while True:
            if isinstance(action, Call):
                params = SamplingParams(max_tokens=action.max_tokens, ignore_eos=True, temperature=0.0)
                call = rt.submit(action.prompt, params, program_id=pid)
                async with call:
                    out = await call.result()
                value = list(out.outputs[0].token_ids)
                if on_call is not None:
                    on_call(out)
            else:
                rt.tool_started(info, "search")
                await anyio.sleep(action.seconds)
                value = action.observation
            action = gen.send(value)
    except StopIteration:
        pass
    kv = rt.program_kv(pid)
    rt.end_program(pid)
    return {"latency_s": time.monotonic() - (start + spec.arrival_s), "calls": info.calls_done,
            "recomputed": kv.recomputed_prefill_tokens, "ttl_hits": kv.ttl_hits, "ttl_misses": kv.ttl_misses}


async def run_programs(rt: agentrt.Runtime, specs: list[ProgramSpec], size: dict[str, Any],
                       on_call: Callable[[RequestOutput], None] | None = None) -> tuple[list[dict[str, Any]], float]:
    """Every program of `specs` at its arrival time on `rt`: each one's `_program` result, and the makespan;
    `on_call` sees each call's output (its metrics: time to first token, tokens from the tiers)."""
    start = time.monotonic()
    results: list[dict[str, Any]] = []

    async def launch(spec: ProgramSpec) -> None:
        results.append(await _program(rt, spec, start, size, on_call))

    async with anyio.create_task_group() as tg:
        for spec in specs:
            tg.start_soon(launch, spec)
    return results, time.monotonic() - start


async def run_one(policy: str, mode: str, specs: list[ProgramSpec], model: str | None, num_blocks: int,
                  size: dict[str, Any] = SIZE) -> dict[str, Any]:
    kw = {**ENGINE, **MODES[mode], "num_blocks": num_blocks}
    policy_kwargs = TTL_POLICY.get(policy, {}) if mode in COMPOSED else {}
    async with agentrt.Runtime(model, policy=policy, policy_kwargs=policy_kwargs, **kw) as rt:
        await agentrt.generate(wl.tokens(random.Random(0), 64), max_tokens=4)  # warm-up, not measured
        kv0 = rt.kv_stats()
        results, makespan = await run_programs(rt, specs, size)
        kv = rt.kv_stats()
    lat = sorted(r["latency_s"] for r in results)
    queries = kv.prefix_queries_tokens - kv0.prefix_queries_tokens
    return {
        "policy": policy, "policy_kwargs": policy_kwargs, "mode": mode, "makespan_s": makespan,
        "recomputed_prefill_tokens": sum(r["recomputed"] for r in results),
        "prefix_hit_rate": (kv.prefix_hit_tokens - kv0.prefix_hit_tokens) / max(1, queries),
        "ttl_hits": kv.ttl_hits - kv0.ttl_hits, "ttl_misses": kv.ttl_misses - kv0.ttl_misses,
        "pin_expiries": kv.pin_expiries - kv0.pin_expiries, "pin_blocks_given_way": kv.pin_blocks_given_way,
        "preemptions": kv.num_preemptions - kv0.num_preemptions,
        "latency_mean_s": statistics.fmean(lat), "latency_p95_s": lat[min(len(lat) - 1, math.ceil(0.95 * len(lat)) - 1)],
        "programs": len(results),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lru = {r["policy"]: r for r in rows if r["mode"] == "lru"}
    out = []
    for r in rows:
        base = lru.get(r["policy"])
        ratio = (f"{base['recomputed_prefill_tokens'] / max(1, r['recomputed_prefill_tokens']):.1f}x fewer"
                 if base is not None and r is not base else "-")
        vs = (f"{r['latency_mean_s'] / base['latency_mean_s']:.2f}x / {r['latency_p95_s'] / base['latency_p95_s']:.2f}x"
              if base is not None else "-")
        out.append([r["policy"], r["mode"], r["recomputed_prefill_tokens"], ratio, f"{r['prefix_hit_rate']:.0%}",
                    f"{r['ttl_hits']} / {r['ttl_misses']}", r["latency_mean_s"], r["latency_p95_s"], vs,
                    r["preemptions"], r["makespan_s"]])
    return _common.markdown_table(
        ["policy", "mode", "recomputed prefill tokens", "vs lru", "prefix hit rate", "TTL hits / misses",
         "latency mean s", "latency p95 s", "mean / p95 vs lru", "preemptions", "makespan s"], out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench retention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=16)
    ap.add_argument("--rate", type=float, default=2.0, help="program arrivals per second (Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=160, help="KV blocks of 16 tokens (memory pressure)")
    ap.add_argument("--policies", default="fcfs,plas")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--task-tokens", type=int, default=SIZE["task"], help="each agent's task prompt")
    ap.add_argument("--tool-median-s", type=float, default=SIZE["tool_median_s"],
                    help="median tool time (log-normal, heavy tail)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write-docs", action="store_true", help="write the table into docs/benchmarks/retention.md")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode {bad[0]!r}; known: {', '.join(MODES)}")
    if args.task_tokens < 1 or not 0 < args.tool_median_s < math.inf:
        raise SystemExit(f"--task-tokens must be >= 1 and --tool-median-s > 0, got {args.task_tokens}, "
                         f"{args.tool_median_s}")
    size = {**SIZE, "task": args.task_tokens, "tool_median_s": args.tool_median_s}
    specs = workload(args.programs, args.rate, args.seed)
    rows = []
    for policy in args.policies.split(","):
        for mode in modes:
            rows.append(anyio.run(run_one, policy, mode, specs, args.model, args.num_blocks, size))
            if not args.json:
                print(f"{policy} {mode}: done in {rows[-1]['makespan_s']:.0f} s", flush=True)
    report = {"config": vars(args), "workload": size, "results": rows}
    print(json.dumps(report, indent=2) if args.json else table(rows))
    if args.write_docs:
        body = (f"{args.programs} agents (`AGENT_SMALL` in agentrt/bench/workload.py, task and tool median as given: {size}), Poisson arrivals at "
                f"{args.rate}/s, seed {args.seed}; engine {ENGINE}, {args.num_blocks} KV blocks of 16 tokens "
                "(the cache holds only part of the active programs' contexts).\n\n" + table(rows))
        _common.write_section("KV retention (real engine)", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
