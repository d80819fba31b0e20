"""Countdown solve rate: MCTS vs one greedy call vs best-of-N sampling, at the same budget of calls.

On the 20 fixed puzzles of `programs/countdown.py`, each method writes arithmetic steps that one
verifier checks (operands available, exact results, the target produced):

- **greedy** — one call at temperature 0 writes a whole solution (one call: more greedy calls
  would repeat it);
- **best-of-N** — N = budget calls at `--temperature` write whole solutions (parallel threads of one
  program); solved when any verifies;
- **MCTS** — `programs/mcts.py` with the same budget: each call proposes one step, `--width`
  proposals per expansion, the verifier prunes malformed steps and scores the rest.

All puzzles of a method run concurrently as programs of one in-process runtime (so the engine
batches them); the methods run one after the other. Output: a table (or `--json`) and, with
`--docs`, the "Countdown" section of docs/benchmarks/countdown.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import anyio

import agentrt
from agentrt.programs.countdown import PUZZLES, Puzzle, parse_solution, prompt, verify
from agentrt.programs.mcts import mcts


@agentrt.program(name="greedy")
async def greedy(puzzle: Puzzle, max_tokens: int) -> dict:
    text = await agentrt.generate(prompt(puzzle), max_tokens=max_tokens, temperature=0, stop=["\n\n"])
    steps = parse_solution(text, puzzle)
    return {"solved": verify(puzzle, steps), "calls": 1, "steps": [str(s) for s in steps]}


@agentrt.program(name="best_of_n")
async def best_of_n(puzzle: Puzzle, n: int, max_tokens: int, temperature: float, seed: int) -> dict:
    texts = await agentrt.gather(*(
        agentrt.generate(prompt(puzzle), max_tokens=max_tokens, temperature=temperature, seed=seed * 100_003 + i,
                         stop=["\n\n"])
        for i in range(n)
    ))
    solutions = [parse_solution(t, puzzle) for t in texts]
    good = [s for s in solutions if verify(puzzle, s)]
    return {"solved": bool(good), "calls": n, "steps": [str(s) for s in (good[0] if good else [])]}


async def _mcts(puzzle: Puzzle, budget: int, width: int, max_tokens: int, temperature: float, seed: int) -> dict:
    r = await mcts(puzzle, budget=budget, width=width, temperature=temperature, max_tokens=max_tokens, seed=seed)
    return {"solved": r.solved, "calls": r.calls, "steps": [str(s) for s in r.steps], "pruned": r.pruned,
            "proposals": r.proposals}


async def run_method(name: str, budget: int, puzzles: list[Puzzle], a: argparse.Namespace) -> dict:
    results: list[dict] = [{}] * len(puzzles)
    rt = agentrt.current_runtime()
    kv0 = rt.kv_stats()
    t = time.perf_counter()

    async def one(i: int, p: Puzzle) -> None:
        if name == "greedy":
            results[i] = await greedy(p, a.max_tokens)
        elif name == "best_of_n":
            results[i] = await best_of_n(p, budget, a.max_tokens, a.temperature, a.seed)
        else:
            results[i] = await _mcts(p, budget, a.width, a.step_tokens, a.temperature, a.seed)

    async with anyio.create_task_group() as tg:
        for i, p in enumerate(puzzles):
            tg.start_soon(one, i, p)
    wall = time.perf_counter() - t
    kv1 = rt.kv_stats()
    infos = [p for p in rt.programs if p.name == name][-len(puzzles):]
    return {
        "method": name, "budget": 1 if name == "greedy" else budget, "solved": sum(r["solved"] for r in results), "puzzles": len(puzzles),
        "calls": sum(r["calls"] for r in results), "output_tokens": sum(p.num_output_tokens for p in infos),
        "prompt_tokens": kv1.prefix_queries_tokens - kv0.prefix_queries_tokens,
        "prefix_hit_tokens": kv1.prefix_hit_tokens - kv0.prefix_hit_tokens, "wall_s": wall,
        "per_puzzle": [{"puzzle": str(p), **r} for p, r in zip(puzzles, results)],
    }


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    keep = ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16"]
                    return " ".join(k for k in keep if k in flags) or "none of avx2/avx512/amx"
    except OSError:
        pass
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench countdown", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--puzzles", type=int, default=len(PUZZLES), help=f"the first N of the {len(PUZZLES)} puzzles")
    ap.add_argument("--budgets", default="8,16", help="LLM calls per puzzle for best-of-N and MCTS (a row pair each)")
    ap.add_argument("--width", type=int, default=4, help="MCTS proposals per expansion")
    ap.add_argument("--max-tokens", type=int, default=40, help="tokens per whole-solution call")
    ap.add_argument("--step-tokens", type=int, default=16, help="tokens per MCTS step proposal")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default="greedy,best_of_n,mcts")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 on a shared 2-core machine)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--docs", action=argparse.BooleanOptionalAction, default=False,
                    help="write this benchmark's section of docs/benchmarks/countdown.md (default: no)")
    a = ap.parse_args(argv)
    if not 1 <= a.puzzles <= len(PUZZLES):
        ap.error(f"--puzzles must be in [1, {len(PUZZLES)}], got {a.puzzles}")
    methods = a.methods.split(",")
    if bad := [m for m in methods if m not in ("greedy", "best_of_n", "mcts")]:
        ap.error(f"unknown methods {bad}; choose from greedy, best_of_n, mcts")
    try:
        budgets = [int(b) for b in a.budgets.split(",")]
    except ValueError:
        ap.error(f"--budgets must be comma-separated integers, got {a.budgets!r}")
    if min(budgets) < 1 or a.width < 1:
        ap.error("--budgets and --width must be >= 1")

    import torch

    from agentrt.bench._common import markdown_table, write_section

    if a.threads:
        torch.set_num_threads(a.threads)
    puzzles = list(PUZZLES[: a.puzzles])

    async def run_all() -> list[dict]:
        async with agentrt.Runtime(a.model, "plas"):
            await agentrt.generate("warm up", max_tokens=2, temperature=0)
            rows = [await run_method("greedy", 1, puzzles, a)] if "greedy" in methods else []
            for b in budgets:
                rows += [await run_method(m, b, puzzles, a) for m in methods if m != "greedy"]
            return rows

    rows = anyio.run(run_all)
    if a.json:
        print(json.dumps({"budgets": budgets, "width": a.width, "rows": rows}, indent=2))
    headers = ["method", "budget", "solved", "solve rate", "calls / puzzle", "output tokens / puzzle", "prefix hit rate",
               "wall s"]
    table = markdown_table(headers, [
        [r["method"], r["budget"], f"{r['solved']}/{r['puzzles']}", f"{r['solved'] / r['puzzles']:.0%}",
         f"{r['calls'] / r['puzzles']:.1f}", f"{r['output_tokens'] / r['puzzles']:.0f}",
         f"{r['prefix_hit_tokens'] / max(1, r['prompt_tokens']):.0%}", f"{r['wall_s']:.0f}"]
        for r in rows
    ])
    if not a.json:
        print(table)
    if a.docs:
        body = (
            f"CPU flags: {cpu_flags()}; load average at the end {os.getloadavg()[0]:.1f}.  \n"
            f"Model: {a.model or 'SmolLM2-135M-Instruct (default)'}; {len(puzzles)} puzzles of `programs/countdown.py`; "
            f"budgets {', '.join(map(str, budgets))} calls per puzzle for best-of-N and MCTS (MCTS width {a.width}), "
            "greedy one call; "
            f"whole solutions up to {a.max_tokens} tokens, MCTS steps up to {a.step_tokens}; "
            f"temperature {a.temperature}, seed {a.seed}. One verifier judges all three.\n\n{table}\n\n"
            "MCTS calls write one step (at most --step-tokens) that the verifier checks and recomputes before "
            "the search goes on from it, so MCTS generates about half the tokens of best-of-N at equal calls; "
            "best-of-N's whole solutions fail at their first wrong step (the model's arithmetic slips). MCTS "
            "stops early when it solves a puzzle or runs out of branches (calls / puzzle below the budget). "
            "Prefix hit rate: prompt tokens served from the prefix cache (every call starts with the same "
            f"few-shot prompt). Wall s: each method's {len(puzzles)} puzzles run concurrently on one in-process engine; "
            "a shared machine, so times are indicative.\n"
        )
        write_section("Countdown", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
