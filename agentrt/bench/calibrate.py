"""Calibrate the simulator's step costs on this machine: time the real engine over a designed set of
batches, fit `agentrt.bench.costs.StepCost`, store the fit for this model, dtype and CPU kind.

    agentrt simulate --calibrate [--model M] [--dtype auto] [--repeats 2] [--json]
    agentrt bench calibrate ...                                   (the same)

The design covers what the benchmarks schedule: prefill of one prompt of 16-1024 tokens (chunked at the
engine's token budget, so chunks of many sizes over growing context), decode of 1-32 rows at contexts
of 32-1024 tokens, mixed steps (rows decoding while a prompt of 64-512 tokens arrives and prefills
beside them) and decode of 4-16 rows over one prefix of 240 or 1008 tokens (parallel calls of a program: the
shared context's price). Every step of the real `EngineCore.step()` is timed (scheduling, input preparation,
forward, sampling, output handling); steps with the same inputs across repeats keep their median time.
The fit is a non-negative least-squares fit of relative error (each step weighs the same, whether it
took 10 ms or 1 s); its error is reported per step and per scenario (a scenario's total time, which
is what a simulation adds up).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentrt.bench import _common, costs
from agentrt.bench.costs import FEATURES, Fit, StepCost, step_features

VOCAB = (1000, 40000)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    requests: tuple[tuple[int, int, int], ...]  # (prompt tokens, output tokens, the step it arrives at)
    shared: int = 0  # the prompts' first `shared` tokens are one prefix (parallel calls of one program)


def design(max_rows: int = 32) -> list[Scenario]:
    out = [Scenario(f"prefill {n}", ((n, 2, 0),)) for n in (16, 64, 128, 256, 512, 1024)]
    for ctx in (32, 256, 1024):
        for rows in (1, 2, 4, 8, 16, 32):
            if rows <= max_rows and rows * ctx <= 16384:
                out.append(Scenario(f"decode {rows} x {ctx}", ((ctx, 10, 0),) * rows))
    for rows in (2, 8):
        for n in (64, 256, 512):
            out.append(Scenario(f"{rows} decoding + prefill {n}", ((128, 24, 0),) * rows + ((n, 2, 4),)))
    for ctx in (256, 1024):  # rows decoding over one prefix: the shared context's price
        for rows in (4, 8, 16):
            if rows <= max_rows:
                out.append(Scenario(f"decode {rows} x {ctx} sharing {ctx - 16}", ((ctx, 10, 0),) * rows, ctx - 16))
    return out


def time_steps(core: Any, scenarios: list[Scenario], repeats: int, seed: int = 0,
               log: Any = None) -> list[tuple[str, tuple[int, ...], float]]:
    """(scenario, features, seconds) for every step of every scenario, `repeats` times over (fresh random
    prompts each time, so the prefix cache never hits, but for a scenario's rows over its `shared` prefix)."""
    from agentrt.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    seen: list[tuple[int, ...]] = []
    core.on_schedule = lambda out: seen.append(step_features(out, core.config.block_size))
    records = []
    try:
        for rep, sc in itertools.product(range(repeats), scenarios):
            pending = sorted(sc.requests, key=lambda r: r[2])
            prefix = [rng.randrange(*VOCAB) for _ in range(sc.shared)]
            reqs, step = [], 0
            t_scenario = time.perf_counter()
            while pending or core.has_work():
                while pending and pending[0][2] <= step:
                    n, out_tokens, _ = pending.pop(0)
                    prompt = prefix[:n] + [rng.randrange(*VOCAB) for _ in range(n - len(prefix[:n]))]
                    reqs.append(core.add_request(prompt, SamplingParams(max_tokens=out_tokens, ignore_eos=True,
                                                                        temperature=0.0)))
                seen.clear()
                t0 = time.perf_counter()
                core.step()
                dt = time.perf_counter() - t0
                if seen and seen[0][1] > 0:
                    records.append((sc.name, seen[0], dt))
                step += 1
            for r in reqs:
                core.finished_output(r)
            if log is not None:
                print(f"  {sc.name} (repeat {rep + 1}/{repeats}): {time.perf_counter() - t_scenario:.2f} s",
                      file=log, flush=True)
    finally:
        core.on_schedule = None
    return records


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0, exactly: the best unconstrained solution over every subset of
    columns whose solution is non-negative (a handful of columns here, so 2^k subsets are cheap)."""
    k = a.shape[1]
    best, best_res = np.zeros(k), float(np.sum(b * b))
    for mask in range(1, 1 << k):
        cols = [i for i in range(k) if mask >> i & 1]
        x, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if np.any(x < 0):
            continue
        res = float(np.sum((a[:, cols] @ x - b) ** 2))
        if res < best_res:
            best_res, best = res, np.zeros(k)
            best[cols] = x
    return best


def fit(records: list[tuple[str, tuple[int, ...], float]]) -> tuple[StepCost, dict[str, float]]:
    """The step-cost model that best reproduces `records` in relative terms, and its errors: per step
    (median, p90, max) and per scenario total (max, mean)."""
    groups: dict[tuple[str, tuple[int, ...]], list[float]] = defaultdict(list)
    for name, x, t in records:
        groups[(name, x)].append(t)
    keys = list(groups)
    x = np.array([k[1] for k in keys], dtype=np.float64)
    t = np.array([statistics.median(groups[k]) for k in keys])
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    coef = nnls(x / scale / t[:, None], np.ones(len(t))) / scale
    cost = StepCost(*coef.tolist())
    if not x[:, FEATURES.index("shared_context")].any():  # no row shared a block: its price is not known
        cost = dataclasses.replace(cost, shared_context_s=None)
    pred = x @ coef
    rel = np.abs(pred - t) / t
    per_scenario: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for k, p, m in zip(keys, pred, t):
        n = len(groups[k])  # the scenario's total over its repeats
        per_scenario[k[0]][0] += p * n
        per_scenario[k[0]][1] += m * n
    sc_err = [abs(p - m) / m for p, m in per_scenario.values()]
    error = {"median_rel": float(np.median(rel)), "p90_rel": float(np.quantile(rel, 0.9)), "max_rel": float(rel.max()),
             "scenario_max_rel": max(sc_err), "scenario_mean_rel": statistics.fmean(sc_err),
             "distinct_steps": len(keys)}
    return cost, error


def calibrate(model: str | None = None, dtype: str | None = None, repeats: int = 2, max_num_seqs: int = 32,
              max_num_batched_tokens: int = 512, seed: int = 0, log: Any = sys.stderr) -> tuple[Fit, list]:
    """Time the real engine, fit, and return the fit (not yet stored) with the raw records.

    The engine is an `AsyncEngine`, as programs use it: the design is timed step by step on its engine
    thread, then `loop_overhead` (what serving adds per step: the hand-off to the event loop and back,
    dispatching tokens) is added to the fitted base cost."""
    from agentrt.engine.async_engine import AsyncEngine

    eng = AsyncEngine(model, dtype=dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      device="cpu")
    core = eng.core
    print(core.startup_line, file=log, flush=True)
    warm = [Scenario("warm-up", ((64, 4, 0), (300, 4, 0)))]
    eng.call_on_engine_thread(lambda: time_steps(core, warm, 1, seed=seed + 1))
    records = eng.call_on_engine_thread(lambda: time_steps(core, design(max_num_seqs), repeats, seed=seed, log=log))
    cost, error = fit(records)
    overhead = loop_overhead(eng, seed=seed + 2)
    eng.close()
    error["loop_overhead_s"] = overhead
    cost = dataclasses.replace(cost, base_s=cost.base_s + overhead)
    key = costs.fit_key(core.model_path.name, core.config.dtype)
    return Fit(key=key, cost=cost, created=costs.today(), error=error, steps=len(records),
               cpu=f"{_common.cpu_name()} ({_common.cpu_flags_line()})"), records


def loop_overhead(eng: Any, seed: int = 0, rows: int = 4, out_tokens: int = 48, repeats: int = 3) -> float:
    """Seconds per step that serving adds to the step itself: the same decode batch timed step by step on
    the engine thread and served by the running `AsyncEngine`, the difference of their totals per step
    (median over `repeats`)."""
    from agentrt.engine.sampling_params import SamplingParams

    core = eng.core
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=out_tokens, ignore_eos=True, temperature=0.0)
    scenario = [Scenario("loop", ((128, out_tokens, 0),) * rows)]

    async def served() -> tuple[float, int]:
        async with eng:
            steps0 = core.num_steps
            t0 = time.perf_counter()
            streams = [eng.add_request([rng.randrange(*VOCAB) for _ in range(128)], params) for _ in range(rows)]
            for s in streams:
                await s.result()
            return time.perf_counter() - t0, core.num_steps - steps0

    import anyio

    diffs = []
    for _ in range(repeats):
        direct = eng.call_on_engine_thread(lambda: time_steps(core, scenario, 1, seed=rng.randrange(1 << 30)))
        wall, steps = anyio.run(served)
        diffs.append((wall - sum(t for _, _, t in direct)) / max(1, steps))
    return max(0.0, statistics.median(diffs))


def describe(f: Fit) -> str:
    c = f.cost
    e = f.error
    return "\n".join([
        f"fit {f.key} on {f.cpu}, {f.steps} timed steps ({e['distinct_steps']} distinct):",
        f"  step_s = {c.base_s * 1e3:.2f} ms + {c.token_s * 1e6:.1f} us/token + {c.decode_row_s * 1e6:.1f} us/decode row"
        f" + {c.context_s * 1e9:.1f} ns/context token + {c.prefill_attn_s * 1e9:.1f} ns/prefill pair"
        f" + {c.sample_s * 1e6:.1f} us/sampled row + "
        + (f"{c.shared_context_s * 1e9:.1f} ns/shared context token" if c.shared_context_s is not None
           else "shared context as context")
        + (f" (base includes {e['loop_overhead_s'] * 1e3:.2f} ms/step of serving overhead)" if "loop_overhead_s" in e
           else ""),
        f"  error per step: median {e['median_rel']:.1%}, p90 {e['p90_rel']:.1%}, max {e['max_rel']:.1%}; "
        f"per scenario total: mean {e['scenario_mean_rel']:.1%}, max {e['scenario_max_rel']:.1%}",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt simulate --calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default=None, help="auto (default) | float32 | bfloat16")
    ap.add_argument("--repeats", type=int, default=2, help="passes over the design (medians over passes)")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--no-store", action="store_true", help="report the fit without storing it")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats!r}")
    t0 = time.monotonic()
    result, _ = calibrate(args.model, args.dtype, args.repeats, args.max_num_seqs, args.max_num_batched_tokens)
    path = None if args.no_store else costs.store(result)
    if args.json:
        print(json.dumps({"key": result.key, "cost": dict(zip(FEATURES, result.cost.coefficients())),
                          "error": result.error, "steps": result.steps, "cpu": result.cpu,
                          "stored": str(path) if path else None, "seconds": time.monotonic() - t0}, indent=2))
    else:
        print(describe(result))
        print(f"calibrated in {time.monotonic() - t0:.0f} s; " + (f"stored in {path}" if path else "not stored"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
