"""`agentrt bench programs --http`: the same programs, through `agentrt serve`, as a user's client sends them.

For each policy a fresh `agentrt serve` (its own process, no records: agentrt/bench/serve.py's `server_process`)
runs the engine; the programs of agentrt/bench/workload.py arrive as a Poisson process and each call goes over
HTTP (`/v1/completions`, token-id prompts, greedy, EOS ignored, `X-Program-Id`, parallel branches with `X-Thread-Id`), tool gaps as sleeps,
every call's generated ids feeding the next prompt as in the in-process run. Recorded per call: its
program, kind, start and end (the timeline), per program its latency; from the server's /metrics its
preemptions and prefix hits. Policies are `agentrt serve --policy` names, their arguments `--policy-kwargs`;
engine settings beyond the seats (`--num-blocks`, `--kv-host-gib`) go to the server as its flags.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx

from agentrt.bench import workload as wl
from agentrt.bench.serve import server_process, wait_healthy
from agentrt.bench.workload import Call, Parallel, ProgramSpec, make_workload

SERVE_POLICIES = ("fcfs", "mlfq", "plas", "plas+ttl", "atlas", "atlas+ttl")


def serve_args(name: str, kwargs: dict[str, Any]) -> list[str]:
    """`agentrt serve` flags for a policy entry beyond `--policy`: its arguments as `--policy-kwargs`; a policy the
    server does not take fails here, naming it."""
    if name not in SERVE_POLICIES:
        raise SystemExit(f"--http: policy {name!r} is not one `agentrt serve --policy` takes ({', '.join(SERVE_POLICIES)})")
    return ["--policy-kwargs", json.dumps(kwargs)] if kwargs else []


def _metric(text: str, name: str) -> float:
    """Sum of a metric's samples in a Prometheus exposition (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@contextlib.contextmanager
def _server(model: str, engine: dict[str, Any], policy: str, flags: list[str]) -> Iterator[tuple[str, Any]]:
    """A fresh `agentrt serve` (agentrt/bench/serve.py's `server_process`) with this policy: (its url, its process)."""
    seats = {k: engine[k] for k in ("max_num_seqs", "max_num_batched_tokens")}
    more = [x for k, v in engine.items() if k not in seats and v is not None for x in (f"--{k.replace('_', '-')}", str(v))]
    args = argparse.Namespace(model=model, policy=policy, dtype=None, kv_cache_gb=None, max_requests=4096, **seats,
                              extra_flags=["--served-model-name", "m", *more, *flags])
    with server_process(args) as served:
        yield served


@contextlib.asynccontextmanager
async def _client(url: str, proc: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A client of that server once it is healthy and has served one short call (warm-up, not measured)."""
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        await wait_healthy(client, proc, 300)
        (await client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})).raise_for_status()
        yield client


async def _program(client: httpx.AsyncClient, spec: ProgramSpec, start: float, results: list[Any],
                   timeline: list[dict[str, Any]]) -> None:
    await anyio.sleep(max(0.0, start + spec.arrival_s - time.monotonic()))
    pid = f"{spec.kind}-{spec.index}"
    calls = 0
    tokens = 0
    in_calls = 0.0  # seconds its calls took, client-side, summed over parallel branches
    tools = 0.0

    async def call(c: Call, thread: str | None = None) -> list[int]:
        nonlocal calls, tokens, in_calls
        body = {"model": "m", "prompt": c.prompt, "max_tokens": c.max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        headers = {"X-Program-Id": pid, **({"X-Thread-Id": thread} if thread else {})}
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=body, headers=headers)
        if r.status_code != 200:
            raise RuntimeError(f"program {pid}: {r.status_code} {r.text[:300]}")
        ids = r.json()["choices"][0]["token_ids"]
        timeline.append({"program": spec.index, "kind": spec.kind, "start": t0 - start, "end": time.monotonic() - start})
        in_calls += time.monotonic() - t0
        calls += 1
        tokens += len(ids)
        return ids

    gen, value = wl.plan(spec), None
    while True:
        try:
            action = gen.send(value)
        except StopIteration:
            break
        if isinstance(action, Call):
            value = await call(action)
        elif isinstance(action, Parallel):
            out: list[Any] = [None] * len(action.calls)

            async def branch(i: int, c: Call, out: list[Any]) -> None:
                out[i] = await call(c, f"t{i}")

            async with anyio.create_task_group() as tg:
                for i, c in enumerate(action.calls):
                    tg.start_soon(branch, i, c, out)
            value = out
        else:
            await anyio.sleep(action.seconds)
            tools += action.seconds
            value = action.observation
    latency = time.monotonic() - (start + spec.arrival_s)
    r = await client.get(f"/v1/programs/{pid}")  # the server's record: queueing, recompute, tier loads
    rec = r.json() if r.status_code == 200 else {}
    results[spec.index] = {"kind": spec.kind, "latency_s": latency, "calls": calls, "output_tokens": tokens,
                           "parts": {"tools_s": tools, "calls_s": in_calls, "queue_s": rec.get("wait_s", float("nan")),
                                     "service_s": rec.get("service_s", float("nan")),
                                     "recomputed_tokens": rec.get("recomputed_prefill_tokens", 0),
                                     "tier_loaded_tokens": rec.get("kv_tier_loaded_tokens", 0),
                                     "prefix_hit_tokens": rec.get("num_prefix_hit_tokens", 0)}}


def run_policy_http(name: str, kwargs: dict[str, Any], workload: list[ProgramSpec], model: str,
                    engine: dict[str, Any]) -> dict[str, Any]:
    """Serve the workload under one policy through a fresh `agentrt serve`; the in-process run's result shape,
    plus the calls' timeline."""
    results: list[dict[str, Any] | None] = [None] * len(workload)
    timeline: list[dict[str, Any]] = []
    with _server(model, engine, name, serve_args(name, kwargs)) as (url, proc):

        async def main() -> tuple[float, str, str]:
            async with _client(url, proc) as client:
                before = (await client.get("/metrics")).text
                start = time.monotonic()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_sample_engine, client, samples)
                    async with anyio.create_task_group() as programs:
                        for spec in workload:
                            programs.start_soon(_program, client, spec, start, results, timeline)
                    tg.cancel_scope.cancel()  # the sampling ends with the last program
                makespan = time.monotonic() - start
                return makespan, before, (await client.get("/metrics")).text

        samples: list[tuple[float, float, float]] = []
        makespan, before, after = anyio.run(main)

    def grew(metric: str) -> float:
        return _metric(after, metric) - _metric(before, metric)

    return {
        "policy": name if not kwargs else f"{name}:" + ":".join(f"{k}={v}" for k, v in kwargs.items()),
        "makespan_s": makespan,
        "utilization": float("nan"),  # not visible over HTTP
        "steps": 0,
        "preemptions": int(grew("agentrt:num_preemptions_total")),
        "prefix_hit_rate": grew("agentrt:prefix_cache_hits_total") / max(1.0, grew("agentrt:prefix_cache_queries_total")),
        "recomputed_prefill_tokens": int(grew("agentrt:recomputed_prefill_tokens_total")),
        # the contention the run assumes, sampled from /metrics every SAMPLE_S: calls running (the batch's width),
        # calls waiting (the queue), and the share of the KV cache in use
        "engine_samples": {"running": _mean(x[0] for x in samples), "waiting": _mean(x[1] for x in samples),
                           "kv_usage": _mean(x[2] for x in samples), "n": len(samples)},
        "programs": [r for r in results if r is not None],
        "timeline": timeline,
    }


SAMPLE_S = 0.5


def _mean(xs: Any) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


async def _sample_engine(client: httpx.AsyncClient, samples: list[tuple[float, float, float]]) -> None:
    while True:
        await anyio.sleep(SAMPLE_S)
        text = (await client.get("/metrics")).text
        samples.append((_metric(text, "agentrt:num_requests_running"), _metric(text, "agentrt:num_requests_waiting"),
                        _metric(text, "agentrt:kv_cache_usage_perc")))


PARTS = ("tools_s", "queue_s", "calls_s", "service_s", "recomputed_tokens", "tier_loaded_tokens")


def breakdown(programs: list[dict[str, Any]], long_kinds: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per class (short, long): mean program latency and the mean of each part over its programs. Calls and
    queueing are summed over a program's calls, parallel branches each counted (they overlap in time)."""
    out = {}
    for cls, members in (("short", [p for p in programs if p["kind"] not in long_kinds]),
                         ("long", [p for p in programs if p["kind"] in long_kinds])):
        if members and all("parts" in p for p in members):
            out[cls] = {"programs": len(members), "latency_s": _mean(p["latency_s"] for p in members),
                        **{k: _mean(p["parts"][k] for p in members) for k in PARTS}}
    return out


def breakdown_table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| policy | class | programs | latency s | tools s | queued s (sum of calls) | in calls s (sum) | service s "
             "| recomputed tokens | tier-loaded tokens | calls running (mean) | calls waiting (mean) | KV in use |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        eng = r.get("engine_samples", {})
        for cls, b in r.get("http_breakdown", {}).items():
            lines.append(f"| {name} | {cls} | {b['programs']} | {b['latency_s']:.2f} | {b['tools_s']:.2f} | {b['queue_s']:.2f} "
                         f"| {b['calls_s']:.2f} | {b['service_s']:.2f} | {b['recomputed_tokens']:.0f} "
                         f"| {b['tier_loaded_tokens']:.0f} | {eng.get('running', float('nan')):.1f} "
                         f"| {eng.get('waiting', float('nan')):.1f} | {eng.get('kv_usage', float('nan')):.0%} |")
    return "\n".join(lines)


def measure_saturation(workload: list[ProgramSpec], model: str, engine: dict[str, Any], seed: int = 0,
                       levels: tuple[int, ...] = (4, 8, 16, 32, 64), settle_s: float = 8.0, measure_s: float = 20.0,
                       poll_s: float = 0.5) -> dict[str, Any]:
    """This server's saturation on this workload's mix, measured: the most output tokens per second a fresh FCFS
    `agentrt serve` sustains with this mix of programs, over a program's mean planned output tokens (programs/s).

    Closed loop, the knee of the throughput curve: N programs of the mix (drawn with the workload's `seed`) are kept
    in flight, a new one starting whenever one ends, for N in `levels` in turn on the same server; after `settle_s`
    at a level, its generated tokens over `measure_s` (/metrics every `poll_s`) is that level's throughput. The
    levels stop once one gives less than the best so far (past the knee: the KV cache thrashes and more programs
    in flight only recompute more). A burst of every program at once, which this measured before, keeps far more
    contexts in flight than an open arrival process near saturation ever does: on a KV-bound pool it measured the
    thrash of the burst (0.29 programs/s on issue 47's 150-block pool, with or without a host tier, where the
    tiered pool served 0.26/s with one call waiting on average)."""
    if not levels or any(n < 1 for n in levels):
        raise ValueError(f"levels must be program counts >= 1, got {levels!r}")
    drawn = make_workload(max(len(workload), 400), 1.0, seed)
    per_program = sum(wl.planned_output_tokens(s) for s in drawn) / len(drawn)
    curve: dict[int, dict[str, float]] = {}
    with _server(model, engine, "fcfs", []) as (url, proc):

        async def level(client: httpx.AsyncClient, n: int, counter: list[int]) -> dict[str, float]:
            samples: list[tuple[float, float, float]] = []  # (time, generated tokens, calls waiting)
            sink: dict[int, Any] = {}

            async def worker() -> None:
                while True:
                    k = counter[0]
                    counter[0] += 1
                    s = drawn[k % len(drawn)]
                    await _program(client, ProgramSpec(k, s.kind, 0.0, s.seed), time.monotonic(), sink, [])

            async with anyio.create_task_group() as tg:
                for _ in range(n):
                    tg.start_soon(worker)
                t0 = time.monotonic()
                while True:
                    await anyio.sleep(poll_s)
                    now = time.monotonic()
                    if now - t0 < settle_s:
                        continue
                    text = (await client.get("/metrics")).text
                    samples.append((now, _metric(text, "agentrt:generation_tokens_total"),
                                    _metric(text, "agentrt:num_requests_waiting")))
                    if samples[-1][0] - samples[0][0] >= measure_s:
                        break
                tg.cancel_scope.cancel()
            seconds = samples[-1][0] - samples[0][0]
            return {"output_tok_s": (samples[-1][1] - samples[0][1]) / seconds,
                    "calls_waiting": _mean(s[2] for s in samples)}

        async def main() -> None:
            async with _client(url, proc) as client:
                counter = [0]
                for n in levels:
                    curve[n] = await level(client, n, counter)
                    if curve[n]["output_tok_s"] < max(c["output_tok_s"] for c in curve.values()):
                        break

        anyio.run(main)
    knee = max(curve, key=lambda n: curve[n]["output_tok_s"])
    tok_s = curve[knee]["output_tok_s"]
    return {"output_tok_s": tok_s, "measured_s": measure_s, "in_flight": knee, "tokens_per_program": per_program,
            "programs_per_s": tok_s / per_program,
            "curve": {str(n): {k: round(v, 2) for k, v in c.items()} for n, c in curve.items()}}


def plot_timeline(report: dict[str, Any], path: str) -> None:
    """One panel per policy: each program a row (by arrival), its calls as bars coloured by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(name, r) for name, r in report["results"].items() if r.get("timeline")]
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 3.2 * len(runs)), sharex=True, squeeze=False)
    colors = {"chat": "tab:blue", "react": "tab:orange", "tree": "tab:red"}
    for ax, (name, r) in zip(axes[:, 0], runs):
        for kind, color in colors.items():
            bars = [(c["program"], c["start"], c["end"] - c["start"]) for c in r["timeline"] if c["kind"] == kind]
            if bars:
                ax.barh([b[0] for b in bars], [b[2] for b in bars], left=[b[1] for b in bars], height=0.8,
                        color=color, alpha=0.6, label=kind)
        lat = r["latency_s"]
        ax.set(ylabel="program", title=f"{name}: mean program latency {lat['mean']:.1f} s, p99 {lat['p99']:.1f} s")
        ax.legend(loc="upper right")
    axes[-1, 0].set(xlabel="seconds since the first arrival")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
