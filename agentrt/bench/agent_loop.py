"""KV memory shaped by the model, measured: an agent loop's prefix hits and time to first token, and the KV a
sliding-window model holds (layer groups, engine.kv_layout) against keeping every block (`swa_full`).

1. Agent loop (default: the real Gemma 3 270M, 15 of its 18 layers a 512-position window): one ReAct-style
   conversation of `--calls` calls; each call's prompt is the last one + its greedy reply + a new tool result
   (`--tool-tokens` of text), growing past 4k tokens. Per call: the tokens it shares with the previous call,
   the tokens served from the prefix cache, its time to first token. Then the last prompt again on a cold
   engine (prefix caching off): its time to first token and its reply (must be the same). Targets: from call
   2 on, cached >= 90% of shared; the last call's TTFT <= 0.2x the cold prefill's.
2. Memory (the engine's scheduler and KV manager on the model's own layer layout, the model's compute left
   out: which blocks are held depends on token counts alone): a `--long-tokens` conversation's KV bytes at its
   last step against the bytes its layer rules require (full layers x every position + window layers x W),
   with layer groups and with `swa_full`; and at one KV budget (`--budget-mib`), how many `--program-tokens`
   programs (prompt + 64 output tokens, all arriving at once; a step's token budget of 64k, so admission waits
   for blocks rather than for prefill time) run at the same time. Targets: <= 1.1x the
   rules' bytes; >= 4x the programs of swa_full.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

WORDS = ("search result page title snippet price weather city station route train ticket hotel review rating "
         "address open close table booking flight gate delay status order item stock warehouse invoice amount "
         "customer account balance error retry timeout success field value").split()


def tool_result(rng: random.Random, n_words: int) -> str:
    return "Observation: " + " ".join(rng.choice(WORDS) for _ in range(n_words)) + "\nThought:"


def agent_loop(llm, calls: int, tool_words: int, max_tokens: int, seed: int) -> tuple[list[dict], list[int], list[int]]:
    """Per call: prompt tokens, tokens shared with the previous call, cached tokens, TTFT; and the last prompt
    and its reply."""
    from agentrt.engine import SamplingParams

    rng = random.Random(seed)
    tok = llm.tokenizer
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompt = tok("Question: plan a three-day trip and book it. Use the tools.\n" + tool_result(rng, tool_words * 2))[
        "input_ids"]
    rows, shared = [], 0
    for k in range(calls):
        (o,) = llm.generate([{"prompt_token_ids": prompt}], params)
        m = o.metrics
        rows.append({"call": k + 1, "prompt_tokens": len(prompt), "shared_tokens": shared,
                     "cached_tokens": o.num_cached_tokens, "ttft_s": m.first_token_time - m.arrival_time})
        reply = o.token_ids
        if k + 1 < calls:
            shared = len(prompt) + len(reply)
            prompt = prompt + reply + tok(tool_result(rng, tool_words), add_special_tokens=False)["input_ids"]
    return rows, prompt, reply


def cold_ttft(llm, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    from agentrt.engine import SamplingParams

    (o,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                       ignore_eos=True))
    return o.metrics.first_token_time - o.metrics.arrival_time, o.token_ids


class _Blocks:
    """The engine's scheduler and KV manager on a layer layout, stepped without a model."""

    def __init__(self, args, layout, num_blocks: int, block_size: int, max_num_seqs: int, max_batched: int):
        from agentrt.engine.config import EngineConfig
        from agentrt.engine.kv_cache_manager import KVCacheManager
        from agentrt.engine.policy import make_policy
        from agentrt.engine.scheduler import Scheduler

        self.kv = KVCacheManager(num_blocks, block_size, layout=layout)
        cfg = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_batched, device="cpu", dtype="float32")
        self.sched = Scheduler(cfg, self.kv, make_policy("fcfs"))

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        from agentrt.engine.request import Request, RequestStatus
        from agentrt.engine.sampling_params import SamplingParams

        for i, p in enumerate(prompts):
            self.sched.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        most_running = last_held = 0
        while self.sched.has_work():
            out = self.sched.schedule()
            most_running = max(most_running, len(self.sched.running))
            last_held = self.kv.num_blocks - self.kv.num_free_blocks
            self.sched.update_from_output(out, 0.0)
            for r in out.reqs:
                if r.num_computed_tokens == r.num_tokens:
                    r.append_token(7)
                    if r.num_output_tokens >= max_tokens:
                        self.sched.finish(r, RequestStatus.FINISHED_LENGTH, "length")
        assert self.kv.num_free_blocks == self.kv.num_blocks, "blocks leaked"
        return {"most_running": most_running, "held_blocks_at_last_step": last_held}


def memory(model: str | None, long_tokens: int, program_tokens: int, programs: int, budget_mib: float,
           block_size: int) -> dict:
    from agentrt.engine.kv_layout import KVLayout
    from agentrt.engine.loader import load_hf_config, resolve_model
    from agentrt.engine.model_args import ModelArgs

    args = ModelArgs.from_hf(load_hf_config(resolve_model(model)))
    per_token_layer = 2 * args.num_kv_heads * args.head_dim * 2  # K and V in bf16
    windows = args.windows or (None,) * args.num_layers
    rule_bytes = sum(long_tokens if w is None else min(w, long_tokens) for w in windows) * per_token_layer
    out = {"layers": args.num_layers, "windows": sorted({w for w in windows if w}),
           "full_layers": sum(w is None for w in windows), "long_tokens": long_tokens,
           "rule_bytes": rule_bytes, "budget_mib": budget_mib, "program_tokens": program_tokens}
    for name, swa_full in (("groups", False), ("swa_full", True)):
        layout = KVLayout.from_args(args, swa_full=swa_full)
        page_bytes = layout.page_layers * block_size * per_token_layer
        n_long = -(-long_tokens // block_size) * layout.num_groups + 8
        # the prompt prefilled in the engine's default chunks (1024 tokens), then a decode step at the last position
        one = _Blocks(args, layout, n_long, block_size, 1, 1024).run([[5] * (long_tokens - 1)], 2)
        budget_blocks = int(budget_mib * 2**20 // page_bytes)
        # a step's token budget large enough that admission waits for blocks, not for prefill time
        many = _Blocks(args, layout, budget_blocks, block_size, 256, 65536).run(
            [[i % 97 + 3] + [5 + i] * (program_tokens - 65) for i in range(programs)], 64)
        out[name] = {"groups": layout.num_groups, "page_layers": layout.page_layers,
                     "long_bytes": one["held_blocks_at_last_step"] * page_bytes,
                     "budget_blocks": budget_blocks, "concurrent_programs": many["most_running"]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench agent-loop", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma-3-270m", help="model name, HF directory or .gguf (default: gemma-3-270m)")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--tool-words", type=int, default=400, help="words per tool result (~1.1 tokens each)")
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy reply length per call")
    ap.add_argument("--long-tokens", type=int, default=32768, help="the long conversation of the memory rows")
    ap.add_argument("--program-tokens", type=int, default=8192, help="each program's context in the concurrency row")
    ap.add_argument("--programs", type=int, default=48, help="programs arriving at once in the concurrency row")
    ap.add_argument("--budget-mib", type=float, default=1024.0, help="the KV budget of the concurrency row")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-loop", action="store_true", help="the memory rows only (no model run)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--docs", action=argparse.BooleanOptionalAction, default=False,
                    help="write docs/benchmarks/agent-loop.md's section (default: no)")
    a = ap.parse_args(argv)
    for name in ("calls", "tool_words", "max_tokens", "long_tokens", "program_tokens", "programs"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.program_tokens <= 65:
        ap.error(f"--program-tokens must be > 65 (64 of them are output), got {a.program_tokens}")

    from agentrt.bench._common import markdown_table, write_section

    res: dict = {"model": a.model, "load_average_at_start": os.getloadavg()[0]}
    res["memory"] = mem = memory(a.model, a.long_tokens, a.program_tokens, a.programs, a.budget_mib, a.block_size)
    if not a.skip_loop:
        from agentrt.engine import LLM

        llm = LLM(a.model, block_size=a.block_size, max_model_len=16384)
        res["engine"] = llm.core.startup_line
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8] * 8}])  # warm-up, shares nothing
        t = time.perf_counter()
        rows, last_prompt, last_reply = agent_loop(llm, a.calls, a.tool_words, a.max_tokens, a.seed)
        res["loop_wall_s"] = time.perf_counter() - t
        del llm
        cold = LLM(a.model, block_size=a.block_size, max_model_len=16384, enable_prefix_caching=False)
        cold.generate([{"prompt_token_ids": [5, 6, 7, 8] * 8}])
        res["cold_ttft_s"], cold_reply = cold_ttft(cold, last_prompt, a.max_tokens)
        res["same_reply"] = cold_reply == last_reply
        res["calls"] = rows
        later = rows[1:]
        res["min_cached_share"] = min((r["cached_tokens"] / r["shared_tokens"] for r in later), default=None)
        res["last_ttft_vs_cold"] = rows[-1]["ttft_s"] / res["cold_ttft_s"]
    res["load_average_at_end"] = os.getloadavg()[0]
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    parts = []
    if "calls" in res:
        table = markdown_table(["call", "prompt tokens", "shared with previous", "cached", "cached / shared", "TTFT s"],
                               [[r["call"], r["prompt_tokens"], r["shared_tokens"], r["cached_tokens"],
                                 f"{r['cached_tokens'] / r['shared_tokens']:.1%}" if r["shared_tokens"] else "-",
                                 f"{r['ttft_s']:.3f}"] for r in res["calls"]])
        parts.append(f"Engine: `{res['engine']}`\n\nAgent loop, {a.calls} calls, tool results of {a.tool_words} words, "
                     f"greedy replies of {a.max_tokens} tokens:\n\n{table}\n\n"
                     f"From call 2 on, cached / shared >= **{res['min_cached_share']:.1%}** (target 90%). "
                     f"Last call's TTFT {res['calls'][-1]['ttft_s']:.3f} s vs a cold prefill of the same "
                     f"{res['calls'][-1]['prompt_tokens']}-token prompt {res['cold_ttft_s']:.3f} s: "
                     f"**{res['last_ttft_vs_cold']:.3f}x** (target <= 0.2x); same greedy reply as the cold engine: "
                     f"**{res['same_reply']}**.")
    g, f = mem["groups"], mem["swa_full"]
    mib = 2**20
    parts.append(
        f"Memory ({mem['layers']} layers: {mem['full_layers']} full, the rest windows {mem['windows']}; the "
        f"engine's scheduler and KV manager on this layout, the model's compute left out):\n\n"
        + markdown_table(["KV layout", "groups x page layers", f"{mem['long_tokens']}-token conversation MiB",
                          "vs layer rules", f"concurrent {mem['program_tokens']}-token programs at {a.budget_mib:g} MiB"],
                         [[name, f"{d['groups']} x {d['page_layers']}", f"{d['long_bytes'] / mib:.1f}",
                           f"{d['long_bytes'] / mem['rule_bytes']:.3f}x", d["concurrent_programs"]]
                          for name, d in (("layer groups (default)", g), ("swa_full (every block)", f))])
        + f"\n\nLayer rules: {mem['rule_bytes'] / mib:.1f} MiB. Concurrent programs, groups / swa_full: "
          f"**{g['concurrent_programs'] / max(1, f['concurrent_programs']):.2f}x** (target >= 4x; "
          f"{a.programs} programs offered).")
    body = "\n\n".join(parts) + f"\n\nLoad average {res['load_average_at_start']:.1f} at the start, " \
                                f"{res['load_average_at_end']:.1f} at the end."
    print(body)
    if a.docs:
        print(f"\nwrote {write_section('Agent loop and KV memory by layer rules', body)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
