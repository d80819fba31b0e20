"""`agentrt bench programs --http`: the same programs, through `agentrt serve`, as a user's client sends them.

For each policy a fresh `agentrt serve` (its own process, no records: bench/serve.py's `server_process`)
runs the engine; the programs of bench/workload.py arrive as a Poisson process and each call goes over
HTTP (`/v1/completions`, token-id prompts, greedy, EOS ignored, `X-Program-Id`, parallel branches with `X-Thread-Id`), tool gaps as sleeps,
every call's generated ids feeding the next prompt as in the in-process run. Recorded per call: its
program, kind, start and end (the timeline), per program its latency; from the server's /metrics its
preemptions and prefix hits. Policies are `agentrt serve --policy` names; `running_cap` is its
`--running-cap`, the one policy argument the server takes.
"""

from __future__ import annotations

import argparse
import contextlib
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
    """`agentrt serve` flags for a policy entry beyond `--policy`; a knob the server does not take fails here,
    naming it."""
    if name not in SERVE_POLICIES:
        raise SystemExit(f"--http: policy {name!r} is not one `agentrt serve --policy` takes ({', '.join(SERVE_POLICIES)})")
    other = sorted(set(kwargs) - {"running_cap"})
    if other:
        raise SystemExit(f"--http: the server takes --policy and --running-cap only, not {other[0]!r} "
                         f"(policy {name!r}); run it in-process, without --http")
    return ["--running-cap", str(kwargs["running_cap"])] if "running_cap" in kwargs else []


def _metric(text: str, name: str) -> float:
    """Sum of a metric's samples in a Prometheus exposition (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@contextlib.contextmanager
def _server(model: str, engine: dict[str, Any], policy: str, flags: list[str]) -> Iterator[tuple[str, Any]]:
    """A fresh `agentrt serve` (bench/serve.py's `server_process`) with this policy: (its url, its process)."""
    args = argparse.Namespace(model=model, policy=policy, dtype=None, kv_cache_gb=None, max_requests=4096, **engine,
                              extra_flags=["--served-model-name", "m", *flags])
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

    async def call(c: Call, thread: str | None = None) -> list[int]:
        nonlocal calls, tokens
        body = {"model": "m", "prompt": c.prompt, "max_tokens": c.max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        headers = {"X-Program-Id": pid, **({"X-Thread-Id": thread} if thread else {})}
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=body, headers=headers)
        if r.status_code != 200:
            raise RuntimeError(f"program {pid}: {r.status_code} {r.text[:300]}")
        ids = r.json()["choices"][0]["token_ids"]
        timeline.append({"program": spec.index, "kind": spec.kind, "start": t0 - start, "end": time.monotonic() - start})
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
            value = action.observation
    results[spec.index] = {"kind": spec.kind, "latency_s": time.monotonic() - (start + spec.arrival_s),
                           "calls": calls, "output_tokens": tokens}


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
                    for spec in workload:
                        tg.start_soon(_program, client, spec, start, results, timeline)
                makespan = time.monotonic() - start
                return makespan, before, (await client.get("/metrics")).text

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
        "programs": [r for r in results if r is not None],
        "timeline": timeline,
    }


def measure_saturation(workload: list[ProgramSpec], model: str, engine: dict[str, Any], seed: int = 0,
                       burst_programs: int = 160, arrive_within_s: float = 5.0, settle_s: float = 5.0,
                       measure_s: float = 20.0, poll_s: float = 0.5) -> dict[str, Any]:
    """This server's saturation on this workload's mix, measured: a fresh FCFS `agentrt serve` given a burst of
    programs of the same mix (`burst_programs` drawn with the workload's `seed`, all arriving within
    `arrive_within_s`), /metrics read every `poll_s`. Once calls have waited for `settle_s` (every seat taken, the
    first prompts computed), its generated tokens per second over `measure_s` more seconds of waiting calls is the
    most it computes with this mix of prefill and decode; over a program's mean planned output tokens, the arrival
    rate it sustains. The burst is then dropped (the server stops)."""
    drawn = make_workload(max(burst_programs, len(workload)), 1.0, seed)
    span = max(s.arrival_s for s in drawn) or 1.0
    burst = [ProgramSpec(s.index, s.kind, s.arrival_s * arrive_within_s / span, s.seed) for s in drawn]
    per_program = sum(wl.planned_output_tokens(s) for s in drawn) / len(drawn)
    samples: list[tuple[float, float]] = []  # (time, generated tokens so far) while calls waited, after settling
    with _server(model, engine, "fcfs", []) as (url, proc):

        async def main() -> None:
            async with _client(url, proc) as client:
                start, done, timeline = time.monotonic(), [None] * len(burst), []
                waited_since: float | None = None
                async with anyio.create_task_group() as tg:
                    for spec in burst:
                        tg.start_soon(_program, client, spec, start, done, timeline)
                    while time.monotonic() - start < 600:
                        await anyio.sleep(poll_s)
                        text = (await client.get("/metrics")).text
                        now = time.monotonic()
                        if _metric(text, "agentrt:num_requests_waiting") == 0:
                            if samples:
                                break  # the backlog cleared before `measure_s`: measure what there was
                            waited_since = None
                            continue
                        waited_since = now if waited_since is None else waited_since
                        if now - waited_since >= settle_s:
                            samples.append((now, _metric(text, "agentrt:generation_tokens_total")))
                            if samples[-1][0] - samples[0][0] >= measure_s:
                                break
                    tg.cancel_scope.cancel()

        anyio.run(main)
    seconds = samples[-1][0] - samples[0][0] if samples else 0.0
    if seconds < min(5.0, measure_s / 2):  # the backlog cleared too soon to say
        raise SystemExit(f"--load with --http: calls waited for only {seconds:.1f} s of the saturation run "
                         f"({len(burst)} programs at once with engine {engine}): the mix cannot fill the seats")
    tok_s = (samples[-1][1] - samples[0][1]) / seconds
    return {"output_tok_s": tok_s, "measured_s": seconds, "burst_programs": len(burst),
            "tokens_per_program": per_program, "programs_per_s": tok_s / per_program}


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
