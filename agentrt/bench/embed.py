"""Embeddings: the engine's pooling path (`LLM.embed`) against HF transformers on the same weights.

Run as `agentrt bench embed [--num-inputs 64] [--shared-prefix 128] [--json] [--docs]` (or `python -m
bench.embed`). Both systems embed the same inputs in the same dtype (the engine's choice for this
machine), last-token pooling, L2-normalized:
- the engine: `LLM.embed` of all inputs at once (continuous batching, chunked prefill, prefix cache);
- HF: the checkpoint's base model (`AutoModel`), inputs sorted by length and run in batches of
  `--hf-batch-size` with right padding, each input's last real token pooled (sentence-transformers'
  way of batching).

Two workloads, each input random token ids of a length drawn from [--min-len, --max-len]:
- `distinct`: the inputs alone;
- `shared prefix`: each after the same `--shared-prefix`-token instruction (as embedding models'
  "Instruct: ... Query: ..." prompts are), which the engine's prefix cache computes once a pass.

Every pass draws new token ids (same lengths), so nothing is cached from an earlier pass. Reported per
workload and system: the best of `--repeats` passes, input tokens/s, engine / HF, and how closely the
vectors agree (lowest cosine similarity of one input's two vectors).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

DOCS_SECTION = "Embeddings"


def _inputs(rng: random.Random, lengths: list[int], prefix_len: int, vocab: int) -> list[list[int]]:
    prefix = [rng.randrange(100, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def hf_embed(hf, inputs: list[list[int]], batch_size: int, pad_id: int) -> list[torch.Tensor]:
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    out: list[torch.Tensor | None] = [None] * len(inputs)
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        width = max(len(inputs[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, : len(inputs[i])] = torch.tensor(inputs[i])
            mask[r, : len(inputs[i])] = 1
        h = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        last = h[torch.arange(len(idx)), mask.sum(1) - 1].float()
        last = last / last.norm(dim=-1, keepdim=True)
        for r, i in enumerate(idx):
            out[i] = last[r]
    return out  # type: ignore[return-value]


def measure(model: str | None, num_inputs: int, min_len: int, max_len: int, prefix_len: int, hf_batch_size: int,
            repeats: int, seed: int, engine_config: dict | None = None) -> dict:
    from transformers import AutoModel

    from agentrt.engine import LLM

    llm = LLM(model, **(engine_config or {}))
    core = llm.core
    dtype = core.config.torch_dtype
    hf = AutoModel.from_pretrained(str(core.model_path), dtype=dtype).eval()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(num_inputs)]
    vocab, pad = core.model.args.vocab_size, core.tokenizer.pad_token_id or 0
    result = {"model": core.model_path.name, "dtype": str(dtype).removeprefix("torch."), "num_inputs": num_inputs,
              "lengths": [min_len, max_len], "shared_prefix": prefix_len, "hf_batch_size": hf_batch_size,
              "repeats": repeats, "workloads": []}
    llm.embed(_inputs(rng, lengths[:4], 0, vocab), progress=False)  # warm-up: kernels built, weights packed
    hf_embed(hf, _inputs(rng, lengths[:4], 0, vocab), hf_batch_size, pad)
    for name, plen in (("distinct", 0), ("shared prefix", prefix_len)):
        times: dict[str, list[float]] = {"engine": [], "hf": []}
        worst = 1.0
        hits = 0
        for _ in range(repeats):
            inputs = _inputs(rng, lengths, plen, vocab)
            t0 = time.perf_counter()
            outs = llm.embed(inputs, progress=False)
            times["engine"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ref = hf_embed(hf, inputs, hf_batch_size, pad)
            times["hf"].append(time.perf_counter() - t0)
            hits += sum(o.metrics.num_prefix_hit_tokens for o in outs)
            for o, r in zip(outs, ref, strict=True):
                worst = min(worst, float(torch.nn.functional.cosine_similarity(torch.tensor(o.embedding), r, dim=0)))
        tokens = sum(lengths) + plen * num_inputs
        best = {k: min(v) for k, v in times.items()}
        result["workloads"].append({
            "name": name, "input_tokens": tokens, "engine_s": best["engine"], "hf_s": best["hf"],
            "engine_tok_s": tokens / best["engine"], "hf_tok_s": tokens / best["hf"],
            "ratio": best["hf"] / best["engine"], "min_cosine": worst,
            "prefix_hit_tokens_per_pass": hits / repeats,
        })
    return result


def markdown(result: dict) -> str:
    from agentrt.bench._common import markdown_table

    rows = [[w["name"], f"{w['input_tokens']:,}", f"{w['engine_tok_s']:,.0f}", f"{w['hf_tok_s']:,.0f}",
             f"**{w['ratio']:.2f}x**", f"{w['prefix_hit_tokens_per_pass']:,.0f}", f"{w['min_cosine']:.6f}"]
            for w in result["workloads"]]
    return "\n".join([
        (f"Model: {result['model']} in {result['dtype']}; {result['num_inputs']} inputs of "
         f"{result['lengths'][0]}-{result['lengths'][1]} random tokens, last-token pooling, normalized; HF: "
         f"`AutoModel` in batches of {result['hf_batch_size']} sorted by length; best of {result['repeats']} "
         "passes, new token ids each pass."),
        "",
        markdown_table(["workload", "input tokens", "engine tok/s", "HF tok/s", "engine / HF",
                        "prefix-cache hits a pass", "lowest cosine"], rows),
        "",
        (f"`shared prefix`: every input after the same {result['shared_prefix']}-token instruction. The first "
         "input of a pass computes it; the others wait for its blocks and read them from the prefix cache "
         "(in-batch prefix sharing)."),
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench embed", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num-inputs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--shared-prefix", type=int, default=128, help="tokens of the shared instruction (second workload)")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the engine's tokens per step")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the markdown table")
    ap.add_argument("--docs", action=argparse.BooleanOptionalAction, default=False,
                    help="write the 'Embeddings' section of docs/benchmarks/embed.md (default: no)")
    a = ap.parse_args(argv)
    for name in ("num_inputs", "min_len", "hf_batch_size", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.max_len < a.min_len or a.shared_prefix < 0:
        ap.error(f"need --min-len <= --max-len and --shared-prefix >= 0, got {a.min_len}, {a.max_len}, "
                 f"{a.shared_prefix}")
    engine = {} if a.max_num_batched_tokens is None else {"max_num_batched_tokens": a.max_num_batched_tokens}
    result = measure(a.model, a.num_inputs, a.min_len, a.max_len, a.shared_prefix, a.hf_batch_size, a.repeats, a.seed,
                     engine)
    print(json.dumps(result, indent=2) if a.json else markdown(result))
    if a.docs:
        from agentrt.bench._common import write_section

        write_section(DOCS_SECTION, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
