"""KV retention benchmark on the real engine: agents under memory pressure, every mode in one run.

    agentrt bench retention [--programs N] [--rate R] [--num-blocks B] [--policies fcfs,plas]
                            [--modes nocache,lru,ttl,ttl+reserve] [--json] [--write-docs]

Agents follow `bench/workload.py`'s `agent_plan` at `AGENT_SMALL` size (ReAct / coding-agent shapes
scaled to a 2-core CPU: a shared system prompt, a task, 4-6 turns of call then tool, log-normal tool
times with a heavy tail). The KV cache (`--num-blocks`) holds only part of the active programs'
contexts, so what survives a tool call depends on the mode:

- nocache: no prefix cache at all;
- lru: the prefix cache, plain LRU (vLLM-like);
- ttl: programs' KV pinned across tool calls for Continuum's TTL (agentrt._retention);
- ttl+reserve: ttl, and every program's observed context reserved (auto_reserve).

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
from typing import Any

import anyio

import agentrt
from agentrt._retention import RetentionConfig
from bench import _common
from bench import workload as wl
from bench.workload import AGENT_SMALL, Call, ProgramSpec
from engine import SamplingParams

MODES = {
    "nocache": {"enable_prefix_caching": False, "retention": False},
    "lru": {"retention": False},
    "ttl": {"retention": True},
    "ttl+reserve": {"retention": RetentionConfig(auto_reserve=True)},
}
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 256}
_PREFIX = wl.tokens(random.Random(99), AGENT_SMALL["system"])


def workload(n: int, rate: float, seed: int) -> list[ProgramSpec]:
    rng = random.Random(seed)
    t, specs = 0.0, []
    for i in range(n):
        specs.append(ProgramSpec(i, "agent", t, rng.randrange(1 << 30)))
        t += rng.expovariate(rate)
    return specs


async def _program(rt: agentrt.Runtime, spec: ProgramSpec, start: float) -> dict[str, Any]:
    await anyio.sleep(max(0.0, start + spec.arrival_s - time.monotonic()))
    rng = random.Random(spec.seed)
    gen = wl.agent_plan(rng, AGENT_SMALL, lambda k: wl.tokens(rng, k), _PREFIX)
    info = rt.start_program(name="agent")
    pid, value, action = info.program_id, None, None
    try:
        action = gen.send(None)
        while True:
            if isinstance(action, Call):
                params = SamplingParams(max_tokens=action.max_tokens, ignore_eos=True, temperature=0.0)
                call = rt.submit(action.prompt, params, program_id=pid)
                async with call:
                    value = list((await call.result()).outputs[0].token_ids)
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


async def run_one(policy: str, mode: str, specs: list[ProgramSpec], model: str | None, num_blocks: int) -> dict[str, Any]:
    kw = {**ENGINE, **MODES[mode], "num_blocks": num_blocks}
    async with agentrt.Runtime(model, policy=policy, **kw) as rt:
        await agentrt.generate(wl.tokens(random.Random(0), 64), max_tokens=4)  # warm-up, not measured
        kv0 = rt.kv_stats()
        start = time.monotonic()
        results: list[dict[str, Any]] = []

        async def launch(spec: ProgramSpec) -> None:
            results.append(await _program(rt, spec, start))

        async with anyio.create_task_group() as tg:
            for spec in specs:
                tg.start_soon(launch, spec)
        makespan = time.monotonic() - start
        kv = rt.kv_stats()
    lat = sorted(r["latency_s"] for r in results)
    queries = kv.prefix_queries_tokens - kv0.prefix_queries_tokens
    return {
        "policy": policy, "mode": mode, "makespan_s": makespan,
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
    ap.add_argument("--programs", type=int, default=10)
    ap.add_argument("--rate", type=float, default=1.0, help="program arrivals per second (Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=64, help="KV blocks of 16 tokens (memory pressure)")
    ap.add_argument("--policies", default="fcfs,plas")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write-docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode {bad[0]!r}; known: {', '.join(MODES)}")
    specs = workload(args.programs, args.rate, args.seed)
    rows = []
    for policy in args.policies.split(","):
        for mode in modes:
            rows.append(anyio.run(run_one, policy, mode, specs, args.model, args.num_blocks))
            if not args.json:
                print(f"{policy} {mode}: done in {rows[-1]['makespan_s']:.0f} s", flush=True)
    report = {"config": vars(args), "workload": AGENT_SMALL, "results": rows}
    print(json.dumps(report, indent=2) if args.json else table(rows))
    if args.write_docs:
        body = (f"{args.programs} agents (`AGENT_SMALL` in bench/workload.py: {AGENT_SMALL}), Poisson arrivals at "
                f"{args.rate}/s, seed {args.seed}; engine {ENGINE}, {args.num_blocks} KV blocks of 16 tokens "
                "(the cache holds only part of the active programs' contexts).\n\n" + table(rows))
        _common.write_section("KV retention (real engine)", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
