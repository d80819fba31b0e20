"""Structured generation: constrained vs unconstrained decoding, same model, same run.

Workload, at each batch size (default 1 and 32): that many requests with short distinct prompts,
each decoding `--output-tokens` (default 128) tokens, greedy. Unconstrained requests ignore EOS;
constrained ones carry a JSON schema (an array of at least 64 records, each a string, an integer,
an enum and a boolean) that cannot close within the budget, so every constrained request decodes
all its tokens under the grammar, through strings, numbers and structure alike.

Two engines on the same weights run the two kinds side by side and take decode steps in turn (the
order flipping each step), so load on a shared machine hits both alike; prefill is excluded. Measured:
- per-step time: wall time of `EngineCore.step` (input prep, forward, mask fill and apply, sampling,
  the matchers' accept), median over a run's decode steps; overhead = the median over step pairs of
  constrained / unconstrained, minus 1, pooled over `--repeats` runs;
- the structured work inside a constrained step, timed in the same runs: mask fill + apply
  (`apply_constraints`) and the matchers' `accept_token` / `is_terminated`;
- grammar compile time: the tokenizer's vocabulary table (once per engine), the schema cold (the
  median of three schemas of the same shape, each compiled for the first time), cached (a hit), and
  a regex and the any-JSON-object grammar cold.
Target: <= 10% per-step overhead at batch 32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads thrash on shared cores

from agentrt.bench._common import markdown_table, write_section


def record_schema(min_items: int = 64) -> dict[str, Any]:
    record = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "qty": {"type": "integer"},
                       "kind": {"type": "string", "enum": ["tool", "part", "food", "book"]}, "ok": {"type": "boolean"}},
        "required": ["name", "qty", "kind", "ok"], "additionalProperties": False,
    }
    return {"type": "object", "properties": {"records": {"type": "array", "items": record, "minItems": min_items}},
            "required": ["records"], "additionalProperties": False}


REGEX = r"[a-z]{3,8}(-[0-9]{2,4}){1,3}"


class _Timed:
    """A matcher that adds the time of its calls to a counter (the fill is timed with the apply)."""

    __slots__ = ("m", "t")

    def __init__(self, matcher: Any, t: dict[str, float]) -> None:
        self.m, self.t = matcher, t

    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> Any:
        return self.m.fill_next_token_bitmask(bitmask, index)

    def accept_token(self, token: int) -> bool:
        t = time.perf_counter()
        ok = self.m.accept_token(token)
        self.t["accept_s"] += time.perf_counter() - t
        return ok

    def is_terminated(self) -> bool:
        t = time.perf_counter()
        done = self.m.is_terminated()
        self.t["accept_s"] += time.perf_counter() - t
        return done


def compile_times(core, schema: dict[str, Any]) -> dict[str, float]:
    """Seconds to build the tokenizer's table and to compile grammars, on a cache of its own."""
    from agentrt.engine.structured import Constraint, GrammarCache

    t = time.perf_counter()
    cache = GrammarCache(core.tokenizer, core.model.args.vocab_size, sorted(core.eos_token_ids))
    out = {"tokenizer_info_s": time.perf_counter() - t}

    def timed(c: Constraint) -> float:
        t = time.perf_counter()
        cache.compile(c)
        return time.perf_counter() - t

    n = schema["properties"]["records"]["minItems"]
    out["schema_cold_s"] = statistics.median(timed(Constraint.json_schema(record_schema(n + k))) for k in (1, 2, 3))
    first = Constraint.json_schema(schema)
    timed(first)
    out["schema_cached_s"] = statistics.median(timed(first) for _ in range(5))
    out["regex_cold_s"] = timed(Constraint("regex", REGEX))
    out["json_object_cold_s"] = timed(Constraint("json_object"))
    return out


def decode_pair(free, con, prompts: list[list[int]], n_out: int, constraint, timers: dict[str, float]) -> dict:
    """One run: the same prompts on both engines, unconstrained on `free`, constrained on `con`;
    the decode steps of the two engines alternate. Per-step wall times of each."""
    from agentrt.engine import SamplingParams

    plain = SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True)
    shaped = SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True, constraint=constraint)
    a = [free.add_request(p, plain) for p in prompts]
    b = [con.add_request(p, shaped) for p in prompts]
    for r in b:
        r.matcher = _Timed(r.matcher, timers)
    for core, reqs in ((free, a), (con, b)):  # prefill, untimed
        while any(r.num_output_tokens == 0 for r in reqs):
            core.step()
    for k in timers:
        timers[k] = 0.0
    t_free: list[float] = []
    t_con: list[float] = []
    i = 0
    while free.has_work() or con.has_work():
        order = ((free, t_free), (con, t_con)) if i % 2 == 0 else ((con, t_con), (free, t_free))
        for core, times in order:
            if core.has_work():
                t = time.perf_counter()
                core.step()
                times.append(time.perf_counter() - t)
        i += 1
    for core, reqs in ((free, a), (con, b)):
        outs = [core.finished_output(r) for r in reqs]
        got = [o.num_output_tokens for o in outs]
        if got != [n_out] * len(reqs):
            raise RuntimeError(f"a request stopped early: {got} output tokens, wanted {n_out} each")
    return {"free_s": t_free, "con_s": t_con, "text": outs[0].text}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench structured", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--output-tokens", type=int, default=128, help="tokens each request decodes")
    ap.add_argument("--repeats", type=int, default=3, help="runs per batch size (their step pairs pooled)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--kv-cache-gb", type=float, default=0.25, help="KV cache of each of the two engines")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--docs", action=argparse.BooleanOptionalAction, default=False,
                    help="write this benchmark's section of docs/benchmarks/structured.md (default: no)")
    a = ap.parse_args(argv)
    batches = [int(x) for x in a.batch_sizes.split(",") if x]

    import agentrt.engine.runner as runner_mod
    from agentrt.engine import LLM
    from agentrt.engine.structured import Constraint

    kw = {"dtype": a.dtype, "max_num_seqs": max(batches), "kv_cache_bytes": int(a.kv_cache_gb * 2**30)}
    free, con = LLM(a.model, **kw).core, LLM(a.model, **kw).core
    schema = record_schema()
    constraint = Constraint.json_schema(schema)
    results: dict[str, Any] = {"model": str(free.model_path), "dtype": free.config.dtype, "device": free.config.device,
                               "output_tokens": a.output_tokens, "repeats": a.repeats,
                               "load_average_start": os.getloadavg()[0]}
    results["compile"] = compile_times(con, schema)
    print(f"compile: {results['compile']}", file=sys.stderr)
    con.compile_constraint(constraint)

    timers = {"mask_s": 0.0, "accept_s": 0.0}
    apply = runner_mod.apply_constraints

    def timed_apply(logits, matchers):
        t = time.perf_counter()
        apply(logits, [m.m if isinstance(m, _Timed) else m for m in matchers])
        timers["mask_s"] += time.perf_counter() - t

    tok = free.tokenizer
    prompts = [tok(f"Write inventory record number {i} as JSON:")["input_ids"] for i in range(max(batches))]
    runner_mod.apply_constraints = timed_apply
    try:
        decode_pair(free, con, prompts[:2], 4, constraint, timers)  # warm-up
        rows = {}
        for bsz in batches:
            free_s, con_s, ratios = [], [], []
            mask_s = accept_s = 0.0
            for _ in range(a.repeats):
                run = decode_pair(free, con, prompts[:bsz], a.output_tokens, constraint, timers)
                free_s.append(statistics.median(run["free_s"]))
                con_s.append(statistics.median(run["con_s"]))
                ratios += [c / f for c, f in zip(run["con_s"], run["free_s"])]
                mask_s += timers["mask_s"] / len(run["con_s"])
                accept_s += timers["accept_s"] / len(run["con_s"])
            row = {
                "free_step_ms": 1e3 * statistics.median(free_s), "con_step_ms": 1e3 * statistics.median(con_s),
                "overhead": statistics.median(ratios) - 1, "overhead_mean": statistics.mean(ratios) - 1,
                "mask_ms": 1e3 * mask_s / a.repeats, "accept_ms": 1e3 * accept_s / a.repeats,
                "steps": len(ratios), "sample": run["text"][:120],
            }
            row["structured_share"] = (row["mask_ms"] + row["accept_ms"]) / row["free_step_ms"]
            rows[bsz] = row
            print(f"batch {bsz}: {row}", file=sys.stderr)
    finally:
        runner_mod.apply_constraints = apply
    results["batches"] = rows
    results["load_average_end"] = os.getloadavg()[0]
    big = max(batches)
    results["target_met"] = rows[big]["overhead"] <= 0.10

    c = results["compile"]
    table = markdown_table(
        ["batch", "unconstrained ms/step", "constrained ms/step", "overhead (median of step pairs)",
         "mask fill + apply ms/step", "accept ms/step", "structured work / free step"],
        [[b, r["free_step_ms"], r["con_step_ms"], f"{r['overhead']:+.1%}", r["mask_ms"], r["accept_ms"],
          f"{r['structured_share']:.1%}"] for b, r in rows.items()],
    )
    ctable = markdown_table(["grammar compile", "ms"], [[what, _ms(c[key])] for what, key in [
        ("tokenizer vocabulary table (once per engine)", "tokenizer_info_s"),
        ("record schema, cold (first compile)", "schema_cold_s"),
        ("record schema, cached (a hit)", "schema_cached_s"),
        (f"regex `{REGEX}`, cold", "regex_cold_s"),
        ("any JSON object, cold", "json_object_cold_s"),
    ]])
    summary = (
        f"{a.output_tokens} decode tokens per request, greedy, {results['dtype']} on {results['device']}; "
        f"constrained: a JSON schema of >= 64 records (string, integer, enum, boolean) that cannot close "
        f"within the budget; unconstrained: ignore_eos. Two engines step in turn; {a.repeats} runs per batch "
        f"size.  \nCPU flags: {_cpu_flags()}; load average {results['load_average_start']:.1f} at the start, "
        f"{results['load_average_end']:.1f} at the end.\n\n{table}\n\n"
        f"Per-step overhead at batch {big}: **{rows[big]['overhead']:+.1%}** (target <= 10%: "
        f"{'met' if results['target_met'] else 'missed'}).\n\n{ctable}\n"
    )
    if a.json:
        print(json.dumps(results, indent=2))
    else:
        print(summary)
    if a.docs:
        write_section("Structured generation", summary)
    return 0


def _ms(s: float) -> str:
    ms = 1e3 * s
    return f"{ms:,.1f}" if ms >= 1 else f"{ms:.3f}"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return "unknown"
    flags = set(line.partition(":")[2].split())
    keep = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16"]
    return " ".join(k for k in keep if k in flags) or "none of sse4.2/avx/avx512/amx"


if __name__ == "__main__":
    raise SystemExit(main())
