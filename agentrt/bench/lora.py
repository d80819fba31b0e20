"""LoRA serving: what adapters cost the engine's decode, against the base model in the same run.

Run as `agentrt bench lora [--batch 16] [--adapters 4] [--rank 16] [--json] [--docs]` (or `python -m
bench.lora`). Random PEFT adapters (`engine.testing.make_lora_adapter`, every projection of every
layer, rank `--rank`) are served unmerged (engine/lora.py). Each workload runs the same requests
(`--batch` prompts of `--prompt-len` random tokens, `--max-tokens` greedy tokens each, EOS ignored):
- `base`: no adapter;
- `1 adapter`: every request on the same adapter;
- `N adapters`: requests spread over `--adapters` adapters, all in one batch;
- the same three with one request at a time (`--single` requests, one after another): the base runs
  the fused one-call C++ decode step, a LoRA request the layer-by-layer path.

Reported: output tokens/s (the best of `--repeats` passes) and each workload's ratio to the base's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

DOCS_SECTION = "LoRA adapters"


def measure(model: str | None, batch: int, single: int, num_adapters: int, rank: int, prompt_len: int,
            max_tokens: int, repeats: int, seed: int) -> dict:
    from agentrt.engine import LLM, LoRARequest, SamplingParams
    from agentrt.engine.testing import make_lora_adapter

    llm = LLM(model, enable_lora=True, max_loras=max(8, num_adapters))
    core = llm.core
    rng = random.Random(seed)
    vocab = core.model.args.vocab_size
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    result = {"model": core.model_path.name, "dtype": core.config.dtype, "batch": batch, "single": single,
              "adapters": num_adapters, "rank": rank, "prompt_len": prompt_len, "max_tokens": max_tokens,
              "repeats": repeats, "workloads": []}
    with tempfile.TemporaryDirectory() as tmp:
        loras = [LoRARequest(f"a{i}", i + 1, str(make_lora_adapter(Path(tmp) / f"a{i}", core.hf_config, rank=rank,
                                                                   alpha=2 * rank, seed=seed + i, std=0.02)))
                 for i in range(num_adapters)]
        for lr in loras:
            core.lora_adapter(lr)  # loaded before timing
        llm.generate([[5] * 20], SamplingParams(max_tokens=4), lora_request=loras[0], progress=False)  # warm-up
        llm.generate([[5] * 20], SamplingParams(max_tokens=4), progress=False)

        def run(n: int, assign, one_at_a_time: bool) -> float:
            best = float("inf")
            for _ in range(repeats):
                prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(n)]
                t0 = time.perf_counter()
                if one_at_a_time:
                    for i, p in enumerate(prompts):
                        llm.generate([p], sp, lora_request=assign(i), progress=False)
                else:
                    llm.generate(prompts, sp, lora_request=[assign(i) for i in range(n)], progress=False)
                best = min(best, time.perf_counter() - t0)
            return n * max_tokens / best

        for mode, n, serial in (("batched", batch, False), ("one at a time", single, True)):
            base = run(n, lambda i: None, serial)
            rows = [("base", base), ("1 adapter", run(n, lambda i: loras[0], serial))]
            if num_adapters > 1 and not serial:
                rows.append((f"{num_adapters} adapters", run(n, lambda i: loras[i % num_adapters], serial)))
            for name, tok_s in rows:
                result["workloads"].append({"mode": mode, "requests": n, "name": name, "tok_s": tok_s,
                                            "ratio": tok_s / base})
    return result


def markdown(result: dict) -> str:
    from agentrt.bench._common import markdown_table

    rows = [[w["mode"], w["requests"], w["name"], f"{w['tok_s']:,.1f}", f"**{w['ratio']:.2f}x**"]
            for w in result["workloads"]]
    return "\n".join([
        (f"Model: {result['model']} in {result['dtype']}; random rank-{result['rank']} adapters on every "
         f"projection (q, k, v, o, gate, up, down) of every layer, served unmerged; {result['prompt_len']}-token "
         f"random prompts, {result['max_tokens']} greedy tokens each; best of {result['repeats']} passes."),
        "",
        markdown_table(["mode", "requests", "workload", "output tok/s", "vs base"], rows),
        "",
        ("`batched`: all requests at once, one batch; `N adapters`: the requests spread over N adapters in "
         "that batch. `one at a time`: a request alone, where the base model runs the fused one-call C++ decode "
         "step and a LoRA request the layer-by-layer path with the adapter's two small matmuls per projection."),
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench lora", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--batch", type=int, default=16, help="requests of the batched workloads")
    ap.add_argument("--single", type=int, default=4, help="requests of the one-at-a-time workloads")
    ap.add_argument("--adapters", type=int, default=4, help="adapters the last batched workload spreads over")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print JSON instead of the markdown table")
    ap.add_argument("--docs", action=argparse.BooleanOptionalAction, default=False,
                    help=f"write the '{DOCS_SECTION}' section of docs/benchmarks/lora.md (default: no)")
    a = ap.parse_args(argv)
    for name in ("batch", "single", "adapters", "rank", "prompt_len", "max_tokens", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    result = measure(a.model, a.batch, a.single, a.adapters, a.rank, a.prompt_len, a.max_tokens, a.repeats, a.seed)
    print(json.dumps(result, indent=2) if a.json else markdown(result))
    if a.docs:
        from agentrt.bench._common import write_section

        write_section(DOCS_SECTION, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
