"""KV tiers benchmark on the real engine: demote instead of drop, load instead of recompute.

    agentrt bench tiers [--programs N] [--rate R] [--num-blocks B] [--ttl-s S] [--configs t0,t1,t1+t2]
                        [--host-gib G] [--small-host-gib G] [--disk-dir DIR] [--json] [--write-docs]

Agents as `agentrt bench retention`'s (agentrt/bench/retention.py: a shared system prompt, a task, turns of call
then tool, the context growing by each tool's observation; `REACT_SMALL`'s shape, ~20 prompt tokens per
output token, with 6-10 turns: Autellix's ReAct programs make ~10.8 calls) under plas with TTL pins, in a
KV cache far too small for the active programs' contexts even with pins, with tools that outlast the TTL
(`--ttl-s`, below the shortest usual tool time): a program's context is gone from T0 by its next call. Configurations, each on a fresh engine, one run:

- t0: the engine's pool only (a lost context is recomputed);
- t1: + a host tier of `--host-gib` (engine.kv_host.HostTier); on a CPU engine its blocks are read where they
  lie (engine.kv_tiers, in-place reads: a hit's first block and last two still copied into T0);
- t1-copy: the same host tier with every hit copied into T0 first (`kv_host_in_place=False`, what a GPU does);
- t1-int8: the same host tier storing int8 blocks (lossy; `--ll` measures its error);
- t1+t2: + a small host tier (`--small-host-gib`, too small for the contexts) over a disk tier in a fresh
  directory (`--disk-dir`, default a temporary one): most loads come from disk;
- t2: the disk tier alone.

`--restart` measures instead what the disk tier keeps across servers, over HTTP with real `agentrt serve`
processes: a conversation's first call (a ~`--context-tokens` user message) on a server with `--kv-disk-dir`;
that server stopped (SIGTERM) and started again on the same directory, the conversation's next call (the
first call, its reply and a new message); the same call on a fresh server without tiers (cold); and two
servers on one directory at once, the first call on one and the next on the other. Reported: the share of
the prompt served from cache (`usage.prompt_tokens_details.cached_tokens`, all from disk on a fresh server:
its T0 is empty) and the call's latency (one output token: the prefill) against the cold one.

Reported per configuration: recomputed prefill tokens (prompt tokens a program had computed in its
previous call, computed again) and the share of t0's saved, prefix hit rate with the part each tier
served, each tier's load cost per token against recomputing one (measured in the same process: a fresh
512-token prefill alone on the engine), program latency mean and p95 and their ratio to t0's. And for the
configurations with a host tier, a second table: the calls that loaded blocks from a tier (on t1, from T1),
their time to first token (engine clock: arrival to first token; mean and median), the tokens loaded, the
share of them read in place, and the T0 blocks the loads took (one per block copied; none read in place).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from typing import Any

import anyio

import agentrt
from agentrt._retention import RetentionConfig
from agentrt.bench import _common
from agentrt.bench import workload as wl
from agentrt.bench.retention import run_programs, workload
from agentrt.engine import SamplingParams
from agentrt.policies.autellix import TTL_SETTINGS

CONFIGS = ("t0", "t1", "t1-copy", "t1-int8", "t1+t2", "t2")
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 256}  # as bench retention's
SIZE = {**wl.REACT_SMALL, "turns": (6, 10), "tool_median_s": 0.5, "tool_sigma": 0.5, "tool_max_s": 3.0}


def tier_options(config: str, host_gib: float, small_host_gib: float, disk_dir: str) -> dict[str, Any]:
    return {"t0": {}, "t1": {"kv_host_gib": host_gib}, "t1-copy": {"kv_host_gib": host_gib, "kv_host_in_place": False},
            "t1-int8": {"kv_host_gib": host_gib, "kv_host_quantization": "int8"},
            "t1+t2": {"kv_host_gib": small_host_gib, "kv_disk_dir": disk_dir},
            "t2": {"kv_disk_dir": disk_dir}}[config]


async def _recompute_s_per_token(rt: agentrt.Runtime, n: int = 512) -> float:
    """Seconds a token of prefill costs, alone on the engine: the best of 3 fresh n-token prompts."""
    best = math.inf
    for i in range(3):
        prompt = wl.tokens(random.Random(1000 + i), n)
        t0 = time.perf_counter()
        call = rt.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        async with call:
            await call.result()
        best = min(best, time.perf_counter() - t0)
    return best / n


async def run_one(config: str, specs, model: str | None, num_blocks: int, ttl_s: float, options: dict[str, Any],
                  size: dict[str, Any] = SIZE) -> dict[str, Any]:
    retention = RetentionConfig(default_ttl_s=ttl_s, max_ttl_s=ttl_s)
    kw = {**ENGINE, **options, "num_blocks": num_blocks}
    async with agentrt.Runtime(model, policy="plas", policy_kwargs=dict(TTL_SETTINGS), retention=retention, **kw) as rt:
        recompute = await _recompute_s_per_token(rt, min(512, num_blocks // 2 * 16))
        kv0 = rt.kv_stats()
        outs = []
        results, makespan = await run_programs(rt, specs, size, outs.append)
        kv = rt.kv_stats()
    loaded = [o.metrics for o in outs if o.metrics is not None and o.metrics.num_tier_loaded_tokens]
    ttfts = sorted(m.first_token_time - m.arrival_time for m in loaded if m.first_token_time is not None)
    lat = sorted(r["latency_s"] for r in results)
    queries = max(1, kv.prefix_queries_tokens - kv0.prefix_queries_tokens)
    bs = kv.block_size
    tiers = {}
    for name, st in kv.tiers.items():
        before = kv0.tiers.get(name)
        hits = st.hits - (before.hits if before else 0)
        load_s = st.load_s - (before.load_s if before else 0.0)
        in_place = st.in_place - (before.in_place if before else 0)
        tiers[name] = {"hit_tokens": hits * bs, "hit_rate": hits * bs / queries, "blocks": st.blocks,
                       "in_place_tokens": in_place * bs, "t0_blocks_for_loads": hits - in_place,
                       "demotions": st.demotions, "evictions": st.evictions, "skipped": st.skipped,
                       "corrupt": st.corrupt, "write_s": st.write_s, "load_s": load_s,
                       "load_s_per_token": load_s / (hits * bs) if hits else None}
    return {
        "config": config, "options": {k: str(v) for k, v in options.items()}, "makespan_s": makespan,
        "recompute_s_per_token": recompute, "queries": queries, "latencies": lat,
        "recomputed_prefill_tokens": sum(r["recomputed"] for r in results),
        "prefix_hit_rate": (kv.prefix_hit_tokens - kv0.prefix_hit_tokens) / queries, "tiers": tiers,
        "ttl_hits": kv.ttl_hits - kv0.ttl_hits, "ttl_misses": kv.ttl_misses - kv0.ttl_misses,
        "preemptions": kv.num_preemptions - kv0.num_preemptions,
        "latency_mean_s": statistics.fmean(lat), "latency_p95_s": lat[min(len(lat) - 1, math.ceil(0.95 * len(lat)) - 1)],
        "programs": len(results), "loaded_calls_ttft_s": ttfts,
        "loaded_tokens": sum(m.num_tier_loaded_tokens for m in loaded),
    }


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One config's runs over several seeds as one row: programs pooled (latency mean and p95 over all of them),
    counts summed, rates and costs weighted by what they are rates of, the makespan and recompute cost averaged."""
    if len(runs) == 1:
        return runs[0]
    lat = sorted(x for r in runs for x in r["latencies"])
    queries = sum(r["queries"] for r in runs)
    tiers: dict[str, dict[str, Any]] = {}
    for name in runs[0]["tiers"]:
        hit = sum(r["tiers"][name]["hit_tokens"] for r in runs)
        load_s = sum(r["tiers"][name]["load_s"] for r in runs)
        tiers[name] = {"hit_tokens": hit, "hit_rate": hit / queries, "load_s": load_s,
                       "load_s_per_token": load_s / hit if hit else None,
                       **{k: sum(r["tiers"][name][k] for r in runs) for k in ("demotions", "evictions", "skipped",
                                                                            "corrupt", "in_place_tokens",
                                                                            "t0_blocks_for_loads")}}
    return {
        "config": runs[0]["config"], "options": runs[0]["options"], "seeds": len(runs), "queries": queries,
        "makespan_s": statistics.fmean(r["makespan_s"] for r in runs),
        "recompute_s_per_token": statistics.fmean(r["recompute_s_per_token"] for r in runs),
        "recomputed_prefill_tokens": sum(r["recomputed_prefill_tokens"] for r in runs),
        "prefix_hit_rate": sum(r["prefix_hit_rate"] * r["queries"] for r in runs) / queries, "tiers": tiers,
        **{k: sum(r[k] for r in runs) for k in ("ttl_hits", "ttl_misses", "preemptions", "programs")},
        "latency_mean_s": statistics.fmean(lat), "latency_p95_s": lat[min(len(lat) - 1, math.ceil(0.95 * len(lat)) - 1)],
        "latencies": lat, "loaded_calls_ttft_s": sorted(x for r in runs for x in r["loaded_calls_ttft_s"]),
        "loaded_tokens": sum(r["loaded_tokens"] for r in runs),
    }


def loads_table(rows: list[dict[str, Any]]) -> str:
    """The calls that loaded from a tier, per configuration with a host tier (module docstring)."""
    out = []
    for r in rows:
        host = r["tiers"].get("host")
        if host is None:
            continue
        t = r["loaded_calls_ttft_s"]
        out.append([r["config"], len(t), f"{statistics.fmean(t) * 1e3:.0f}" if t else "-",
                    f"{statistics.median(t) * 1e3:.0f}" if t else "-", r["loaded_tokens"],
                    f"{host['in_place_tokens'] / host['hit_tokens']:.0%}" if host["hit_tokens"] else "-",
                    host["t0_blocks_for_loads"]])
    return _common.markdown_table(
        ["config", "calls loading from tiers", "their TTFT mean ms", "TTFT median ms", "tokens loaded",
         "T1 tokens read in place", "T0 blocks taken by loads"], out)


def table(rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["config"] == "t0"), None)
    out = []
    for r in rows:
        saved = (f"{1 - r['recomputed_prefill_tokens'] / base['recomputed_prefill_tokens']:.1%}"
                 if base is not None and r is not base and base["recomputed_prefill_tokens"] else "-")
        parts = ", ".join(f"{n} {t['hit_rate']:.0%}" for n, t in r["tiers"].items()) or "-"
        cost = ", ".join(f"{n} {t['load_s_per_token'] * 1e6:.1f} us ({t['load_s_per_token'] / r['recompute_s_per_token']:.1%})"
                         for n, t in r["tiers"].items() if t["load_s_per_token"] is not None) or "-"
        vs = (f"{r['latency_mean_s'] / base['latency_mean_s']:.2f}x / {r['latency_p95_s'] / base['latency_p95_s']:.2f}x"
              if base is not None else "-")
        out.append([r["config"], r["recomputed_prefill_tokens"], saved, f"{r['prefix_hit_rate']:.0%}", parts,
                    f"{r['recompute_s_per_token'] * 1e6:.0f} us", cost, r["latency_mean_s"], r["latency_p95_s"], vs,
                    r["makespan_s"]])
    return _common.markdown_table(
        ["config", "recomputed prefill tokens", "saved vs t0", "prefix hit rate", "loaded from tier (per prompt token)",
         "recompute / token", "load / token (vs recompute)", "latency mean s", "latency p95 s", "mean / p95 vs t0",
         "makespan s"], out)


_WORDS = ["agent", "tool", "call", "plan", "search", "result", "file", "code", "test", "error", "fix", "review", "memory", "cache", "token", "block", "program", "latency", "server", "engine", "schedule", "request", "reply", "context", "prompt", "model", "trace", "step", "answer", "question"]


def _conversation(n_words: int) -> list[dict[str, str]]:
    rng = random.Random(7)
    text = " ".join(rng.choice(_WORDS) for _ in range(n_words))
    return [{"role": "system", "content": "You are a careful coding agent."},
            {"role": "user", "content": f"Here is the log so far:\n{text}\nSummarize it."}]


async def _chat(client, messages: list[dict[str, str]], max_tokens: int) -> tuple[dict[str, Any], float]:
    t0 = time.perf_counter()
    r = await client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": max_tokens,
                                                        "temperature": 0})
    r.raise_for_status()
    return r.json(), time.perf_counter() - t0


def restart_rows(context_tokens: int, model: str | None) -> list[dict[str, Any]]:
    """The --restart measurements (module docstring): one row per case."""
    from agentrt.bench.programs_http import _client, _server
    from agentrt.engine.loader import resolve_model

    model = str(resolve_model(model))
    engine = {"max_num_seqs": 8, "max_num_batched_tokens": 512}
    first = _conversation(int(context_tokens / 1.3))

    def nxt(reply: str) -> list[dict[str, str]]:
        return [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Now fix the first error."}]

    async def call(flags: list[str], messages: list[dict[str, str]], max_tokens: int) -> tuple[dict[str, Any], float]:
        with _server(model, engine, "plas", flags) as (url, proc):
            async with _client(url, proc) as client:
                return await _chat(client, messages, max_tokens)

    async def shared(flags: list[str]) -> tuple[dict[str, Any], float]:
        with _server(model, engine, "plas", flags) as (url_a, proc_a), _server(model, engine, "plas", flags) as (url_b, proc_b):
            async with _client(url_a, proc_a) as a, _client(url_b, proc_b) as b:
                out, _ = await _chat(a, first, 32)
                await anyio.sleep(0.5)  # the first server's writer puts its blocks on disk (write-through)
                return await _chat(b, nxt(out["choices"][0]["message"]["content"]), 1)

    def row(case: str, out: dict[str, Any], latency: float, cold: float | None) -> dict[str, Any]:
        u = out["usage"]
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return {"case": case, "prompt_tokens": u["prompt_tokens"], "cached_tokens": cached,
                "cached_share": cached / u["prompt_tokens"], "latency_s": latency,
                "speedup_vs_cold": None if cold is None else cold / latency}

    with tempfile.TemporaryDirectory(prefix="agentrt-kv-") as d1, tempfile.TemporaryDirectory(prefix="agentrt-kv-") as d2:
        disk = ["--kv-disk-dir", d1]
        out1, _ = anyio.run(call, disk, first, 32)  # the server stops (SIGTERM) when it returns
        messages = nxt(out1["choices"][0]["message"]["content"])
        resumed, t_resumed = anyio.run(call, disk, messages, 1)
        cold, t_cold = anyio.run(call, [], messages, 1)
        other, t_other = anyio.run(shared, ["--kv-disk-dir", d2])
    return [row("cold (no tiers, fresh server)", cold, t_cold, None),
            row("after a restart on the same disk tier", resumed, t_resumed, t_cold),
            row("on another server sharing the disk tier", other, t_other, t_cold)]


_TEXT = ("The engine keeps a paged cache of keys and values for every sequence it serves. When memory runs short, the "
         "least recently used blocks are evicted, and a later request that shares their prefix must compute them "
         "again. Agents make this the common case: a tool call can outlast the time a program's blocks are pinned, "
         "and the next call of the program repeats its whole context as its prompt. A hierarchy of memory tiers "
         "moves such blocks to host memory or to a local disk instead of dropping them, and loads them back when "
         "the program returns, which costs microseconds per token where recomputing costs milliseconds. ") * 4


def ll_delta(model: str | None, n_tokens: int = 48) -> dict[str, Any]:
    """The int8 host tier's error: the log-likelihood of a fixed text's next `n_tokens` tokens (the exact model's
    greedy continuation) given its prefix, with the prefix's KV exact (in T0) and loaded back from an int8 T1
    (its first block and recent window exact, as the tier keeps them); per-token mean delta in nats."""
    from agentrt.engine.llm import LLM

    def loglik(llm: LLM, prefix: list[int], cont: list[int]) -> list[float]:
        out = []
        for k in range(len(cont)):
            p = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=20)
            top = dict(llm.generate([prefix + cont[:k]], p, progress=False)[0].outputs[0].top_logprobs[0])
            out.append(top.get(cont[k], min(top.values())))  # absent from the top 20: at most the 20th's
        return out

    exact = LLM(model, num_blocks=256)
    prefix = exact.tokenizer(_TEXT)["input_ids"][:1024]
    bs = exact.core.kv.block_size
    prefix = prefix[: len(prefix) // bs * bs]
    cont = list(exact.generate([prefix], SamplingParams(max_tokens=n_tokens, temperature=0.0), progress=False)[0]
                .outputs[0].token_ids)
    ref = loglik(exact, prefix, cont)
    blocks = len(prefix) // bs + 8
    lossy = LLM(model, num_blocks=blocks, kv_host_gib=0.5, kv_host_quantization="int8")
    lossy.generate([prefix], SamplingParams(max_tokens=1), progress=False)  # the prefix's blocks, cached in T0
    other = [t + 1 for t in prefix]  # a prompt as long as the prefix, sharing none of it: T0 demotes the prefix
    lossy.generate([other], SamplingParams(max_tokens=1), progress=False)
    demoted = lossy.core.kv_stats().tiers["host"].demotions
    got = loglik(lossy, prefix, cont)
    tier = lossy.core.kv_stats().tiers["host"]
    return {"prefix_tokens": len(prefix), "tokens": len(cont), "blocks_demoted": demoted, "host_hits": tier.hits,
            "exact_ll": sum(ref), "int8_ll": sum(got), "delta_per_token": (sum(got) - sum(ref)) / len(cont),
            "max_abs_delta": max(abs(a - b) for a, b in zip(got, ref))}


def restart_table(rows: list[dict[str, Any]]) -> str:
    return _common.markdown_table(
        ["case", "prompt tokens", "cached tokens", "served from cache", "latency s (1 output token)", "vs cold"],
        [[r["case"], r["prompt_tokens"], r["cached_tokens"], f"{r['cached_share']:.0%}", r["latency_s"],
          "-" if r["speedup_vs_cold"] is None else f"{r['speedup_vs_cold']:.1f}x faster"] for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench tiers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=16)
    ap.add_argument("--rate", type=float, default=2.0, help="program arrivals per second (Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=1, help="workload draws, pooled (configs interleaved seed by seed)")
    ap.add_argument("--num-blocks", type=int, default=160, help="KV blocks of 16 tokens in T0 (memory pressure)")
    ap.add_argument("--ttl-s", type=float, default=0.1, help="the programs' pin TTL (tools last longer)")
    ap.add_argument("--configs", default="t0,t1,t1-copy,t1-int8,t1+t2,t2")
    ap.add_argument("--host-gib", type=float, default=1.0, help="T1's size in t1")
    ap.add_argument("--small-host-gib", type=float, default=0.05, help="T1's size in t1+t2")
    ap.add_argument("--disk-dir", default=None, help="T2's directory (default: a fresh temporary one per run)")
    ap.add_argument("--restart", action="store_true", help="measure restart and sharing over HTTP instead")
    ap.add_argument("--ll", action="store_true", help="measure the int8 host tier's log-likelihood error instead")
    ap.add_argument("--context-tokens", type=int, default=2000, help="--restart: the first call's prompt, roughly")
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write-docs", action="store_true", help="write the table into docs/benchmarks/tiers.md")
    args = ap.parse_args(argv)
    configs = args.configs.split(",")
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        raise SystemExit(f"unknown config {bad[0]!r}; known: {', '.join(CONFIGS)}")
    if args.programs < 1 or args.num_blocks < 1 or not 0 <= args.ttl_s < math.inf:
        raise SystemExit(f"--programs and --num-blocks must be >= 1 and --ttl-s >= 0, got {args.programs}, "
                         f"{args.num_blocks}, {args.ttl_s}")
    if args.ll:
        r = ll_delta(args.model)
        line = (f"int8 host tier on a fixed text: {r['prefix_tokens']}-token prefix loaded back from T1 "
                f"({r['host_hits']} blocks), log-likelihood of the next {r['tokens']} tokens {r['int8_ll']:.3f} vs exact "
                f"{r['exact_ll']:.3f} nats: {r['delta_per_token']:+.4f} nats/token (largest per-token change "
                f"{r['max_abs_delta']:.4f})")
        print(json.dumps(r, indent=2) if args.json else line)
        if args.write_docs:
            _common.write_section("int8 host tier error (bench tiers --ll)", line)
        return 0
    if args.restart:
        rows = restart_rows(args.context_tokens, args.model)
        print(json.dumps(rows, indent=2) if args.json else restart_table(rows))
        if args.write_docs:
            _common.write_section("KV disk tier across restarts and servers (bench tiers --restart)",
                                  f"A ~{args.context_tokens}-token conversation over HTTP (`agentrt serve`, plas).\n\n"
                                  + restart_table(rows))
        return 0
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for seed in range(args.seed, args.seed + args.seeds):  # seeds outer: a drift of the machine falls on every config
        specs = workload(args.programs, args.rate, seed)
        for config in configs:
            with tempfile.TemporaryDirectory(prefix="agentrt-kv-") as tmp:
                options = tier_options(config, args.host_gib, args.small_host_gib, args.disk_dir or tmp)
                runs[config].append(anyio.run(run_one, config, specs, args.model, args.num_blocks, args.ttl_s, options))
            if not args.json:
                print(f"seed {seed} {config}: done in {runs[config][-1]['makespan_s']:.0f} s", flush=True)
    rows = [pooled(runs[c]) for c in configs]
    report = {"config": vars(args), "workload": SIZE, "engine": ENGINE, "results": rows}
    loads = loads_table(rows) if any("host" in r["tiers"] for r in rows) else ""
    print(json.dumps(report, indent=2) if args.json else table(rows) + ("\n\n" + loads if loads else ""))
    if args.write_docs:
        body = (f"{args.programs} agents (`REACT_SMALL` shape, {SIZE['turns'][0]}-{SIZE['turns'][1]} turns, tools "
                f"{SIZE['tool_median_s']} s median), Poisson arrivals "
                f"at {args.rate}/s, seeds {args.seed}-{args.seed + args.seeds - 1} pooled; plas with TTL pins of {args.ttl_s} s (tools outlast them); engine "
                f"{ENGINE}, {args.num_blocks} KV blocks of 16 tokens in T0; t1: {args.host_gib} GiB host tier; t1+t2: "
                f"{args.small_host_gib} GiB host tier over a disk tier; t1-copy: t1 with every hit copied into T0 "
                f"(no in-place reads).\n\n" + table(rows)
                + (f"\n\nCalls that loaded from a tier (t1 reads T1 in place, t1-copy copies it):\n\n{loads}" if loads else ""))
        _common.write_section("KV tiers (bench tiers, real engine)", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
