"""Where a program's time goes: every step of an in-process run, logged, and each call's time split into its parts.

`agentrt bench programs --breakdown` (in-process runs) attaches a `StepLog` to the engine (its `on_schedule` hook:
each batch before it runs, on the engine thread) and afterwards splits every call's latency (engine arrival to the
end of its last step) into:

- queue: arrival to its first step (waiting for a seat or blocks, and behind the policy's order);
- own compute: its share of the steps it was in as if it had run alone (the step's fixed cost plus its own rows:
  its prefill, its decode row, its context);
- width: the other calls' decode rows in those steps (a wider batch makes every row's step longer);
- others' prefill: the other calls' prefill chunks in those steps;
- between steps: the rest (waiting again after a preemption, and the engine's work between steps).

A step's parts come from this machine's calibrated step-cost model (`agentrt.bench.costs.StepCost`: the fixed cost and each
row's cost from its features), scaled so that they add up to the step's measured time. Per program class, the
mean over programs of the sums over its calls, and the program's remaining time (tool gaps, the client's work)
are reported; for a program with parallel calls the sums count each branch (its calls overlap).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

from agentrt.bench.costs import StepCost

PARTS = ("queue", "own", "width", "prefill", "between")


class StepLog:
    """Each step's start, the engine's busy time before it, and its rows (request, program, tokens, computed
    before, prompt+output length, arrival). Appended on the engine thread; read after the run."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.steps: list[tuple[float, float, list[tuple[str, str | None, int, int, int, float]]]] = []

    def __call__(self, out: Any) -> None:
        rows = [(r.request_id, r.program_id, n, r.num_computed_tokens, r.num_tokens, r.arrival_time)
                for r, n in zip(out.reqs, out.num_tokens)]
        self.steps.append((time.monotonic(), self.core.busy_s, rows))


def call_parts(log: StepLog, cost: StepCost) -> dict[str, dict[str, float]]:
    """Per request id: its program, latency and the parts above (seconds), from the logged steps. The last
    step (its duration unknown) is left out."""
    calls: dict[str, dict[str, Any]] = {}
    for (t0, busy0, rows), (t1, busy1, _) in zip(log.steps, log.steps[1:]):
        measured = busy1 - busy0
        costs = [cost.row_cost(n, done, total) for _, _, n, done, total, _ in rows]
        predicted = cost.base_s + sum(costs)
        scale = measured / predicted if predicted > 0 else 0.0
        decode = sum(c for c, row in zip(costs, rows) if row[2] == 1)
        prefill = sum(c for c, row in zip(costs, rows) if row[2] > 1)
        for c, (rid, pid, n, _, _, arrival) in zip(costs, rows):
            rec = calls.get(rid)
            if rec is None:
                rec = calls[rid] = {"program": pid, "arrival": arrival, "first": t0, "end": t1, "steps": 0, "rows": 0,
                                    **{p: 0.0 for p in PARTS}}
            rec["end"], rec["steps"], rec["rows"] = t1, rec["steps"] + 1, rec["rows"] + len(rows)
            rec["own"] += scale * (cost.base_s + c)
            rec["width"] += scale * (decode - (c if n == 1 else 0.0))
            rec["prefill"] += scale * (prefill - (c if n > 1 else 0.0))
    for rec in calls.values():
        rec["latency"] = rec["end"] - rec["arrival"]
        rec["queue"] = max(0.0, rec["first"] - rec["arrival"])
        rec["between"] = max(0.0, rec["latency"] - rec["queue"] - rec["own"] - rec["width"] - rec["prefill"])
    return calls


def by_class(calls: dict[str, dict[str, Any]], programs: dict[str, dict[str, Any]],
             long_kinds: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per class ("short", "long"): mean program latency, and per program the mean of each part summed over its
    calls, the rest of its latency ("tools_client"), its calls' steps and their mean batch width."""
    per_program: dict[str, dict[str, float]] = defaultdict(lambda: {p: 0.0 for p in (*PARTS, "steps", "rows")})
    for rec in calls.values():
        acc = per_program[rec["program"]]
        for p in (*PARTS, "steps", "rows"):
            acc[p] += rec[p]
    out: dict[str, dict[str, float]] = {}
    for cls in ("short", "long"):
        pids = [pid for pid, p in programs.items() if (p["kind"] in long_kinds) == (cls == "long") and pid in per_program]
        if not pids:
            continue
        row = {"programs": len(pids), "latency": statistics.fmean(programs[pid]["latency_s"] for pid in pids)}
        for p in PARTS:
            row[p] = statistics.fmean(per_program[pid][p] for pid in pids)
        row["tools_client"] = statistics.fmean(
            max(0.0, programs[pid]["latency_s"] - sum(per_program[pid][p] for p in PARTS)) for pid in pids)
        row["steps"] = statistics.fmean(per_program[pid]["steps"] for pid in pids)
        row["width_rows"] = (sum(per_program[pid]["rows"] for pid in pids)
                             / max(1.0, sum(per_program[pid]["steps"] for pid in pids)))
        out[cls] = row
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| policy | class | program s | queue | own compute | width (others' decode) | others' prefill "
             "| between steps | tool gaps, client | steps | mean batch rows |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        for cls, row in r.get("breakdown", {}).items():
            lines.append(f"| {name} | {cls} | {row['latency']:.2f} | {row['queue']:.2f} | {row['own']:.2f} | "
                         f"{row['width']:.2f} | {row['prefill']:.2f} | {row['between']:.2f} | {row['tools_client']:.2f} "
                         f"| {row['steps']:.0f} | {row['width_rows']:.1f} |")
    return "\n".join(lines)
