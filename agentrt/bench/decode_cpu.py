"""Decode step on CPU: what one greedy token costs the engine in each dtype, against the weight stream.

Run as `agentrt bench decode-cpu [--contexts 300,1500] [--json] [--docs]` (or `python -m agentrt.bench.decode_cpu`).
It builds the default model once per dtype (float32 and bfloat16) in one process and times the engine's
multi-step decode call (`Model.decode_steps`: every layer, the final norm, the LM head and the argmax
for `--steps` tokens, one C++ call on CPU) for one sequence at each context length, the dtypes
interleaved call by call, so a neighbour's load on a shared machine lands on both alike. Measured:
- per token, p10 and median over `--repeats` calls, per dtype and context, and bf16 / fp32 of each:
  the kernel-level ratio behind `agentrt bench throughput`'s single-request row, without the scheduler,
  sampler or request bookkeeping;
- the weight stream: bytes of weights a token reads (packed projections and the LM head), and the read
  bandwidth of the same run (a `torch.sum` over 512 MB of fp32, the best of 7); "of bandwidth" is the
  time streaming the weights at that rate would take over the measured p10;
- attention per position: the slope of the p10 between the shortest and the longest context, and the
  K/V bytes a token reads per position over it (effective GB/s of decode attention).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

DOCS_SECTION = "Decode step (CPU {kind})"  # one section per kind of CPU kernels
DTYPES = ("float32", "bfloat16")


def _read_gbps() -> float:
    x = torch.ones(128 * 1024 * 1024, dtype=torch.float32)  # 512 MB
    x.sum()
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / min(times) / 1e9


def measure(contexts: list[int], steps: int, repeats: int, model: str | None = None) -> dict:
    from agentrt.engine import LLM
    from agentrt.engine.runner import ModelRunner
    from agentrt.kernels import cpu

    block_size = 16
    need = -(-(max(contexts) + steps) // block_size) + 1
    llms = {d: LLM(model, dtype=d, num_blocks=need, block_size=block_size, enable_prefix_caching=False) for d in DTYPES}
    models = {d: llm.core.model for d, llm in llms.items()}
    caches = {d: llm.core.runner.kv_cache for d, llm in llms.items()}
    table = torch.arange(need, dtype=torch.int32).unsqueeze(0)
    stop = torch.full((1, 1), -1, dtype=torch.long)
    ids = torch.tensor([42])
    result: dict = {"kernels": cpu.describe(), "threads": torch.get_num_threads(), "steps": steps,
                    "repeats": repeats, "read_gb_per_s": _read_gbps(), "dtypes": {}}
    per_token: dict[str, dict[int, list[float]]] = {d: {c: [] for c in contexts} for d in DTYPES}
    for _ in range(3):  # the first calls pack the weights and build the kernels
        for d in DTYPES:
            models[d].decode_steps(ids, torch.tensor([contexts[0]]), caches[d], table, stop, steps)
    for c in contexts:
        pos = torch.tensor([c])
        for _ in range(repeats):
            for d in DTYPES:
                t0 = time.perf_counter()
                models[d].decode_steps(ids, pos, caches[d], table, stop, steps)
                per_token[d][c].append((time.perf_counter() - t0) / steps)
    for d in DTYPES:
        m = models[d]
        wbytes = sum(w.numel() * w.element_size() for _, w in m.streamed_weights())
        rows = []
        for c in contexts:
            ts = sorted(per_token[d][c])
            p10 = ts[len(ts) // 10]
            rows.append({"context": c, "p10_ms": p10 * 1e3, "median_ms": statistics.median(ts) * 1e3,
                         "of_bandwidth": wbytes / (result["read_gb_per_s"] * 1e9) / p10})
        kv_bytes = ModelRunner.bytes_per_block(m.args, 1, m.embed_tokens.weight.dtype)  # one position, all layers
        entry = {"weight_bytes": wbytes, "kv_bytes_per_position": kv_bytes, "rows": rows}
        if len(contexts) > 1:
            lo, hi = rows[0], rows[-1]
            slope_s = (hi["p10_ms"] - lo["p10_ms"]) / 1e3 / (hi["context"] - lo["context"])
            if slope_s > 0:  # else the host's noise hid it
                entry["attention_us_per_position"] = slope_s * 1e6
                entry["attention_gb_per_s"] = entry["kv_bytes_per_position"] / slope_s / 1e9
        result["dtypes"][d] = entry
    result["ratio"] = [
        {"context": c,
         "p10": result["dtypes"]["float32"]["rows"][i]["p10_ms"] / result["dtypes"]["bfloat16"]["rows"][i]["p10_ms"],
         "median": (result["dtypes"]["float32"]["rows"][i]["median_ms"]
                    / result["dtypes"]["bfloat16"]["rows"][i]["median_ms"])}
        for i, c in enumerate(contexts)
    ]
    return result


def markdown(result: dict) -> str:
    from agentrt.bench._common import markdown_table

    rows = []
    for d, e in result["dtypes"].items():
        for r in e["rows"]:
            rows.append([d, r["context"], f"{r['p10_ms']:.2f}", f"{r['median_ms']:.2f}",
                         f"{1e3 / r['p10_ms']:.1f}", f"{100 * r['of_bandwidth']:.0f}%"])
    lines = [
        f"Kernels: {result['kernels']}; {result['threads']} threads; one sequence, {result['steps']} greedy tokens "
        f"per `decode_steps` call, {result['repeats']} calls per dtype and context, the dtypes interleaved.",
        f"Read bandwidth of this run (torch.sum over 512 MB fp32, best of 7): {result['read_gb_per_s']:.1f} GB/s. "
        + "; ".join(f"{d}: {e['weight_bytes'] / 1e6:.0f} MB of weights a token" for d, e in result["dtypes"].items())
        + ".",
        "",
        markdown_table(["dtype", "context", "p10 ms/token", "median ms/token", "tok/s (p10)", "of bandwidth"], rows),
        "",
        "bf16 / fp32 per token: " + "; ".join(
            f"context {r['context']}: **{r['p10']:.2f}x** at p10, {r['median']:.2f}x at the median" for r in result["ratio"]),
    ]
    att = [(d, e) for d, e in result["dtypes"].items() if e.get("attention_us_per_position") is not None]
    if att:
        lines += ["", "Decode attention (slope of p10 over context): " + "; ".join(
            f"{d} {e['attention_us_per_position']:.2f} us a position = {e['attention_gb_per_s']:.1f} GB/s of K/V"
            for d, e in att) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench decode-cpu", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--contexts", default="300,1500", help="context lengths (positions before the token), comma-separated")
    ap.add_argument("--steps", type=int, default=8, help="greedy tokens per decode_steps call")
    ap.add_argument("--repeats", type=int, default=30, help="timed calls per dtype and context")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the markdown table")
    ap.add_argument("--docs", action=argparse.BooleanOptionalAction, default=False,
                    help="write this CPU kind's 'Decode step' section of docs/benchmarks/decode-cpu.md (default: no)")
    a = ap.parse_args(argv)
    try:
        contexts = sorted({int(c) for c in a.contexts.split(",") if c.strip()})
    except ValueError:
        ap.error(f"--contexts must be comma-separated integers, got {a.contexts!r}")
    if not contexts or contexts[0] < 1:
        ap.error(f"--contexts must be positive, got {a.contexts!r}")
    if a.steps < 1 or a.repeats < 1:
        ap.error(f"--steps and --repeats must be >= 1, got {a.steps} and {a.repeats}")
    result = measure(contexts, a.steps, a.repeats, a.model)
    text = markdown(result)
    print(json.dumps(result, indent=2) if a.json else text)
    if a.docs:
        from agentrt.bench._common import write_section
        from agentrt.kernels import cpu

        write_section(DOCS_SECTION.format(kind=cpu.kind()), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
