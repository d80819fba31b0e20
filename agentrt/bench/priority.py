"""Priority classes on the real engine: one interactive agent among batch agents, with and without
its class, under each policy.

    agentrt bench priority [--batch-programs 16] [--batch-calls 2] [--batch-tokens 32] [--prompt-tokens 128]
                           [--turns 6] [--turn-tokens 8] [--think-s 1.0] [--max-num-seqs 4]
                           [--policies fcfs,plas] [--model M] [--json] [--docs]

Batch programs start together and each makes `--batch-calls` calls of `--prompt-tokens` prompt and
`--batch-tokens` output tokens, back to back: with `--max-num-seqs` seats, most of them queue. Once
they are all in, an interactive program makes `--turns` calls of `--turn-tokens` tokens with
`--think-s` between them (a user reading). Every policy runs twice on the same workload: the
interactive program in class 0 like the batch, then in class -1 (`Runtime.start_program(priority=-1)`;
`priority` on the HTTP API). Programs are driven by id, as the server drives them; outputs ignore
EOS, so every run does the same work. Reported per (policy, class): the interactive calls' latency
(arrival to last token) mean and max and TTFT max, the batch's output tokens/s and makespan (start to
its last program's end), the
preemptions, and the interactive mean latency without / with its class under the same policy.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import anyio

import agentrt
from agentrt.bench import _common
from agentrt.engine import SamplingParams
from agentrt.policies import POLICY_NAMES

DOCS_SECTION = "Priority classes"


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


async def run_one(policy: str, interactive_class: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    batch_prompts = [[_prompt(rng, args.prompt_tokens) for _ in range(args.batch_calls)]
                     for _ in range(args.batch_programs)]
    turn_prompts = [_prompt(rng, 32) for _ in range(args.turns)]
    async with agentrt.Runtime(args.model, policy=policy, max_num_seqs=args.max_num_seqs) as rt:
        await agentrt.generate(_prompt(rng, 32), max_tokens=2)  # warm-up, not measured
        kv0 = rt.kv_stats()
        batch_tokens: list[int] = []
        batch_ends: list[float] = []
        turns: list[dict[str, float]] = []
        start = time.monotonic()

        async def batch(prompts: list[list[int]]) -> None:
            pid = rt.start_program(name="batch").program_id
            for p in prompts:
                call = rt.submit(p, SamplingParams(max_tokens=args.batch_tokens, temperature=0, ignore_eos=True),
                                 program_id=pid)
                async with call:
                    batch_tokens.append((await call.result()).num_output_tokens)
            rt.end_program(pid)
            batch_ends.append(time.monotonic())

        async def interactive() -> None:
            deadline = time.monotonic() + 30
            while rt.num_waiting_calls() < args.batch_programs - args.max_num_seqs and time.monotonic() < deadline:
                await anyio.sleep(0.01)  # until the queue has formed
            pid = rt.start_program(name="interactive", priority=interactive_class).program_id
            for p in turn_prompts:
                t0 = time.monotonic()
                call = rt.submit(p, SamplingParams(max_tokens=args.turn_tokens, temperature=0, ignore_eos=True),
                                 program_id=pid)
                async with call:
                    out = await call.result()
                m = out.metrics
                turns.append({"latency_s": time.monotonic() - t0, "ttft_s": m.first_token_time - m.arrival_time})
                await anyio.sleep(args.think_s)
            rt.end_program(pid)

        async with anyio.create_task_group() as tg:
            for prompts in batch_prompts:
                tg.start_soon(batch, prompts)
            tg.start_soon(interactive)
        makespan = max(batch_ends) - start  # the batch's: the interactive program's thinking is not work
        kv = rt.kv_stats()
    lat = [t["latency_s"] for t in turns]
    return {"policy": policy, "interactive_class": interactive_class,
            "interactive_latency_mean_s": statistics.fmean(lat), "interactive_latency_max_s": max(lat),
            "interactive_ttft_max_s": max(t["ttft_s"] for t in turns),
            "batch_tokens_per_s": sum(batch_tokens) / makespan, "makespan_s": makespan,
            "preemptions": kv.num_preemptions - kv0.num_preemptions}


def table(rows: list[dict[str, Any]]) -> str:
    base = {r["policy"]: r for r in rows if r["interactive_class"] == 0}
    out = []
    for r in rows:
        b = base.get(r["policy"])
        gain = (f"{b['interactive_latency_mean_s'] / r['interactive_latency_mean_s']:.2f}x"
                if b is not None and r is not b else "-")
        out.append([r["policy"], r["interactive_class"], r["interactive_latency_mean_s"],
                    r["interactive_latency_max_s"], r["interactive_ttft_max_s"], gain, r["batch_tokens_per_s"],
                    r["makespan_s"], r["preemptions"]])
    return _common.markdown_table(
        ["policy", "interactive class", "interactive latency mean s", "max s", "TTFT max s",
         "mean class 0 / this", "batch tok/s", "makespan s", "preemptions"], out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench priority", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-programs", type=int, default=16)
    ap.add_argument("--batch-calls", type=int, default=2)
    ap.add_argument("--batch-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--turn-tokens", type=int, default=8)
    ap.add_argument("--think-s", type=float, default=1.0)
    ap.add_argument("--max-num-seqs", type=int, default=4, help="seats in the batch (the rest queue)")
    ap.add_argument("--policies", default="fcfs,plas")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--docs", action="store_true", help="write the table into docs/benchmarks/priority.md")
    args = ap.parse_args(argv)
    counts = {k: getattr(args, k) for k in ("batch_programs", "batch_calls", "batch_tokens", "prompt_tokens", "turns",
                                            "turn_tokens", "max_num_seqs")}
    bad = [f"--{k.replace('_', '-')} {v}" for k, v in counts.items() if v < 1]
    if bad or args.think_s < 0 or args.batch_programs <= args.max_num_seqs:
        ap.error(f"counts must be >= 1, --think-s >= 0 and --batch-programs > --max-num-seqs (a queue to wait in); "
                 f"got {', '.join(bad) or f'--think-s {args.think_s}, --batch-programs {args.batch_programs}'}")
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        ap.error(f"unknown policy {unknown[0]!r}; known: {', '.join(POLICY_NAMES)}")
    rows = []
    for policy in policies:
        for cls in (0, -1):
            rows.append(anyio.run(run_one, policy, cls, args))
            if not args.json:
                print(f"{policy}, interactive class {cls}: done in {rows[-1]['makespan_s']:.1f} s", flush=True)
    print(json.dumps({"config": vars(args), "results": rows}, indent=2) if args.json else table(rows))
    if args.docs:
        body = (f"{args.batch_programs} batch programs x {args.batch_calls} calls ({args.prompt_tokens} prompt + "
                f"{args.batch_tokens} output tokens each), {args.max_num_seqs} seats; one interactive program of "
                f"{args.turns} calls ({args.turn_tokens} tokens, {args.think_s} s apart) once the queue has formed; "
                "the engine in its default dtype, greedy, EOS ignored.\n\n" + table(rows))
        _common.write_section(DOCS_SECTION, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
