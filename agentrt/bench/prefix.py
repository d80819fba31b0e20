"""Prefix caching: multi-turn chats with a shared system prompt, cache on vs off, in one run.

Workload: C conversations (default 8) of T turns (default 4) on the default model, greedy. All
conversations share a ~200-token system prompt; each turn appends the previous answer and a new
short user message and goes through the chat template. Turn k of every conversation is one
`LLM.generate` batch. The same turns run on an engine with prefix caching and on one without
(warm-up excluded), and the answers must be token-for-token equal.

Reported per turn and overall: prompt tokens, tokens served from the prefix cache (hit rate),
prefill tokens computed (prompt tokens minus hits), wall time with and without the cache and their
ratio. Target: from turn 2 on, >= 90% of every turn's prompt tokens come from the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # only effective before torch loads; see --threads

SYSTEM_PROMPT = (
    "You are the customer assistant of Brick & Bolt, a family-owned hardware store on Mill Street. "
    "The store opens from nine in the morning to six in the evening on weekdays and from ten to four "
    "on Saturdays; it is closed on Sundays and public holidays. It sells hand tools, power tools, "
    "paint, brushes and rollers, screws, nails, bolts, glue, lumber cut to size, garden supplies, "
    "seeds and soil, and plumbing and electrical parts. Ladders, drills, sanders and pressure washers "
    "can be rented by the day with a deposit and a photo ID. Paint can be mixed to any colour while "
    "the customer waits. Orders over fifty dollars are delivered for free within five miles. "
    "Returns are accepted within thirty days with a receipt. Gift cards never expire and can be used "
    "online as well as in the store. Answer in one or two short, friendly "
    "sentences, do not invent prices, and suggest calling the store for anything you do not know."
)
QUESTIONS = [
    "Are you open on Sunday?", "Can I rent a drill?", "Do you mix paint?", "Do you deliver?",
    "Can I return a saw?", "Do you cut lumber?", "Do you sell seeds?", "What about Saturday?",
    "Is a deposit needed?", "Do you sell glue?", "How far do you deliver?", "Do you have ladders?",
    "Can I pay by card?", "Where are you?", "Do you sell nails?", "What about holidays?",
]


def conversations(n: int, turns: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [rng.sample(QUESTIONS, turns) for _ in range(n)]


def run(llm, questions: list[list[str]], params) -> list[dict]:
    """All conversations, turn by turn; per turn: prompts, outputs, hits, wall time."""
    tok = llm.tokenizer
    chats = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in questions]
    turns = []
    for k in range(len(questions[0])):
        for chat, qs in zip(chats, questions):
            chat.append({"role": "user", "content": qs[k]})
        prompts = [tok(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False))["input_ids"] for c in chats]
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t
        for chat, o in zip(chats, outs):
            chat.append({"role": "assistant", "content": o.text})
        prompt_tokens = sum(len(p) for p in prompts)
        hits = sum(o.metrics.num_prefix_hit_tokens for o in outs)
        turns.append({
            "turn": k + 1,
            "prompt_tokens": prompt_tokens,
            "hit_tokens": hits,
            "prefill_tokens": prompt_tokens - hits,
            "output_tokens": sum(o.num_output_tokens for o in outs),
            "wall_s": wall,
            "token_ids": [o.token_ids for o in outs],
        })
    return turns


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench prefix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24, help="answer length cap per turn (greedy)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: on a shared 2-core machine two OpenMP threads "
                         "spin-waiting on each other are several times slower)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--docs", action=argparse.BooleanOptionalAction, default=False,
                    help="write this benchmark's section of docs/benchmarks/prefix.md (default: no)")
    a = ap.parse_args(argv)
    if not 1 <= a.turns <= len(QUESTIONS):
        ap.error(f"--turns must be in [1, {len(QUESTIONS)}], got {a.turns}")
    if a.conversations < 1:
        ap.error(f"--conversations must be >= 1, got {a.conversations}")

    import torch

    from agentrt.bench._common import markdown_table, write_section
    from agentrt.engine import LLM, SamplingParams

    if a.threads:
        torch.set_num_threads(a.threads)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0)
    questions = conversations(a.conversations, a.turns, a.seed)
    results: dict = {"conversations": a.conversations, "turns": a.turns, "max_tokens": a.max_tokens,
                     "block_size": a.block_size, "seed": a.seed, "threads": torch.get_num_threads()}
    results["load_average_at_start"] = os.getloadavg()[0]
    runs = {}
    for on in (True, False):
        llm = LLM(a.model, enable_prefix_caching=on, block_size=a.block_size, seed=a.seed)
        warm = [list(range(1000 + 7 * i, 1040 + 7 * i)) for i in range(2)]  # shares nothing with the chats
        llm.generate(warm, SamplingParams(max_tokens=4, temperature=0))
        before = llm.kv_stats()
        t = time.perf_counter()
        turns = run(llm, questions, params)
        wall = time.perf_counter() - t
        after = llm.kv_stats()
        runs[on] = {
            "wall_s": wall,
            "turns": turns,
            "dedup_merges": after.dedup_merges - before.dedup_merges,
            "evictions": after.evictions - before.evictions,
            "preemptions": after.num_preemptions - before.num_preemptions,
        }
        results["system_prompt_tokens"] = len(llm.tokenizer(SYSTEM_PROMPT)["input_ids"])
        del llm

    on, off = runs[True], runs[False]
    mismatches = [
        (k + 1, c) for k, (t_on, t_off) in enumerate(zip(on["turns"], off["turns"]))
        for c, (x, y) in enumerate(zip(t_on["token_ids"], t_off["token_ids"])) if x != y
    ]
    per_turn = []
    for t_on, t_off in zip(on["turns"], off["turns"]):
        per_turn.append({
            "turn": t_on["turn"],
            "prompt_tokens": t_on["prompt_tokens"],
            "hit_tokens": t_on["hit_tokens"],
            "hit_rate": t_on["hit_tokens"] / t_on["prompt_tokens"],
            "prefill_tokens_on": t_on["prefill_tokens"],
            "prefill_tokens_off": t_off["prefill_tokens"],
            "output_tokens": t_on["output_tokens"],
            "wall_s_on": t_on["wall_s"],
            "wall_s_off": t_off["wall_s"],
            "speedup": t_off["wall_s"] / t_on["wall_s"],
        })
    later = per_turn[1:]
    later_prompt = sum(t["prompt_tokens"] for t in later)
    results.update({
        "per_turn": per_turn,
        "hit_rate_after_first_turn": sum(t["hit_tokens"] for t in later) / later_prompt if later else None,
        "min_turn_hit_rate_after_first": min((t["hit_rate"] for t in later), default=None),
        "prefill_tokens_on": sum(t["prefill_tokens_on"] for t in per_turn),
        "prefill_tokens_off": sum(t["prefill_tokens_off"] for t in per_turn),
        "wall_s_on": on["wall_s"],
        "wall_s_off": off["wall_s"],
        "speedup": off["wall_s"] / on["wall_s"],
        "dedup_merges_on": on["dedup_merges"],
        "evictions_on": on["evictions"],
        "preemptions": {"on": on["preemptions"], "off": off["preemptions"]},
        "outputs_equal": not mismatches,
        "mismatches": mismatches,
    })
    results["target_met"] = bool(later) and results["min_turn_hit_rate_after_first"] >= 0.9

    rows = [[t["turn"], t["prompt_tokens"], t["hit_tokens"], f"{100 * t['hit_rate']:.1f}%", t["prefill_tokens_on"],
             t["prefill_tokens_off"], t["wall_s_on"], t["wall_s_off"], f"{t['speedup']:.2f}x"] for t in per_turn]
    rows.append(["all", sum(t["prompt_tokens"] for t in per_turn), sum(t["hit_tokens"] for t in per_turn),
                 f"{100 * sum(t['hit_tokens'] for t in per_turn) / sum(t['prompt_tokens'] for t in per_turn):.1f}%",
                 results["prefill_tokens_on"], results["prefill_tokens_off"], on["wall_s"], off["wall_s"],
                 f"{results['speedup']:.2f}x"])
    table = markdown_table(["turn", "prompt tokens", "cache hits", "hit rate", "prefill on", "prefill off",
                            "wall s on", "wall s off", "off / on"], rows)
    hit_later = results["hit_rate_after_first_turn"]
    summary = (
        f"{a.conversations} conversations x {a.turns} turns, shared system prompt of "
        f"{results['system_prompt_tokens']} tokens, answers greedy up to {a.max_tokens} tokens, block size "
        f"{a.block_size}, {results['threads']} torch thread(s), seed {a.seed}. Turn k of all conversations is one "
        "batch; prefill = prompt tokens minus prefix-cache hits.\n\n"
        f"{table}\n\n"
        + (f"Hit rate over turns >= 2: **{100 * hit_later:.1f}%** (lowest turn "
           f"{100 * results['min_turn_hit_rate_after_first']:.1f}%; target >= 90% every turn: "
           f"{'met' if results['target_met'] else '**not met**'}). " if later else "")
        + f"Prefill tokens computed: {results['prefill_tokens_on']} with the cache vs {results['prefill_tokens_off']} "
        f"without ({results['prefill_tokens_off'] / max(1, results['prefill_tokens_on']):.1f}x fewer). "
        f"Wall time {on['wall_s']:.1f} s vs {off['wall_s']:.1f} s: **{results['speedup']:.2f}x**. "
        f"Dedup merges with the cache: {on['dedup_merges']} (identical full blocks computed in the same step; "
        "turn 1's system prompt is computed once, by its first conversation, the others waiting a step for its "
        "blocks: in-batch prefix sharing). "
        f"Preemptions on/off: {on['preemptions']}/{off['preemptions']}. "
        f"Outputs with and without the cache: {'identical' if not mismatches else f'**differ** at {mismatches}'}. "
        f"Load average at start: {results['load_average_at_start']:.1f} (a shared machine: wall times are noisy; "
        "the token counts are exact).\n"
    )
    if a.json:
        print(json.dumps(results, indent=2))
    else:
        print(summary)
    if a.docs:
        write_section("Prefix caching", summary)
    return 0 if not mismatches else 1


if __name__ == "__main__":
    raise SystemExit(main())
