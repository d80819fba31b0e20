"""Throughput: this engine vs HF transformers `generate`, same model, same dtype, same run.

Workload: N requests (default 64), prompt lengths uniform in [16, 512], output lengths uniform in
[16, 256], ignore_eos, greedy, fixed seed. Measured:
- engine: all requests through `LLM.generate` (continuous batching);
- HF batched: left-padded `generate` in batches of 8/16/32/64 (best reported); a batch decodes until
  its longest request is done, so only each request's own output tokens count as useful;
- single request, one at a time, on a subset: decode tokens/s of HF and of the engine, as
  (out - 1) / (t(out tokens) - t(1 token)), i.e. prefill excluded.
- with `--speculative K` (default 3; 0 = skip), the engine again with n-gram speculative decoding
  (K drafts per step, exact for greedy), reported in separate rows: plain decoding stays the
  headline comparison. Prompts of random token ids make a small model loop, which prompt lookup
  exploits, so these rows show what speculation does on repetitive output, not on natural text.

On a GPU machine without the checkpoint, `--random-weights smollm2-135m|llama-3.1-8b` builds a
model of that shape with random weights (tokenizer from `--tokenizer`, default: the default
model's); the engine and HF then run the same weights, and a check prints how many of the first
`--check-requests` requests get HF's greedy tokens (first token, and all `--check-tokens`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from bench._common import markdown_table, write_section


def workload(n: int, seed: int, vocab_lo: int = 100, vocab_hi: int = 40000):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        p = rng.randint(16, 512)
        o = rng.randint(16, 256)
        reqs.append(([rng.randrange(vocab_lo, vocab_hi) for _ in range(p)], o))
    return reqs


def run_engine(llm, reqs) -> float:
    from engine import SamplingParams

    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in reqs]
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    dt = time.perf_counter() - t
    assert [o.num_output_tokens for o in outs] == [o for _, o in reqs]
    return dt


@torch.inference_mode()
def run_hf_batched(hf, reqs, batch_size: int, pad_id: int) -> float:
    dev = hf.device
    t = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, (p, _) in enumerate(chunk):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        new = max(o for _, o in chunk)
        hf.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t


@torch.inference_mode()
def hf_single(hf, prompt, new: int, pad_id: int) -> float:
    ids = torch.tensor([prompt], device=hf.device)
    t = time.perf_counter()
    hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t


@torch.inference_mode()
def check_against_hf(llm, hf, reqs, new: int, pad_id: int) -> dict:
    """Greedy tokens of the engine vs HF (one request at a time, unpadded) on the same weights."""
    from engine import SamplingParams

    outs = llm.generate([p for p, _ in reqs], SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    first = full = agree = 0
    for (p, _), o in zip(reqs, outs, strict=True):
        ids = torch.tensor([p], device=hf.device)
        want = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=pad_id)[0, len(p):].tolist()
        got = list(o.token_ids)
        first += got[:1] == want[:1]
        full += got == want
        agree += next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    n = len(reqs)
    return {"requests": n, "tokens": new, "first_token_match": first / n, "all_tokens_match": full / n,
            "mean_tokens_before_divergence": agree / n}


def engine_single(llm, prompt, new: int) -> float:
    from engine import SamplingParams

    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench throughput", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--hf-batch-sizes", default="8,16,32,64")
    ap.add_argument("--single-requests", type=int, default=4, help="requests timed one at a time (0 = skip)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--speculative", type=int, default=3, help="n-gram drafts per step for the extra rows (0 = skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random-weights", default=None, metavar="PRESET",
                    help="random weights of a real shape instead of --model: smollm2-135m or llama-3.1-8b")
    ap.add_argument("--tokenizer", default=None, help="model directory to take the tokenizer from (--random-weights)")
    ap.add_argument("--kv-cache-gb", type=float, default=None, help="engine KV cache size (default: the engine's)")
    ap.add_argument("--check-requests", type=int, default=8, help="requests compared with HF token by token")
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    a = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from engine import LLM, EngineConfig

    hf = None
    if a.random_weights is not None:
        import atexit
        import shutil
        import tempfile

        from engine.testing import make_random_model

        cfg = EngineConfig(dtype=a.dtype)  # the engine's default device and dtype
        a.model = tempfile.mkdtemp(prefix=f"agentrt-{a.random_weights}-")
        atexit.register(shutil.rmtree, a.model, True)
        _, hf = make_random_model(a.model, a.random_weights, dtype=cfg.torch_dtype, device=cfg.device,
                                  seed=a.seed, tokenizer_from=a.tokenizer)
    kw = {"dtype": a.dtype, "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens}
    if a.kv_cache_gb is not None:
        kw["kv_cache_bytes"] = int(a.kv_cache_gb * 2**30)
    llm = LLM(a.model, **kw)
    spec = LLM(a.model, num_speculative_tokens=a.speculative, **kw) if a.speculative else None
    dtype = llm.core.config.torch_dtype
    if hf is None:
        hf = AutoModelForCausalLM.from_pretrained(str(llm.core.model_path), dtype=dtype)
    hf = hf.to(llm.core.config.device).eval()
    pad_id = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    reqs = workload(a.num_requests, a.seed)
    useful = sum(o for _, o in reqs)

    warm = workload(2, a.seed + 1)
    run_engine(llm, [(p[:32], 4) for p, _ in warm])
    if spec is not None:
        run_engine(spec, [(p[:32], 4) for p, _ in warm])
    run_hf_batched(hf, [(p[:32], 4) for p, _ in warm], 2, pad_id)

    results: dict = {"num_requests": a.num_requests, "output_tokens": useful, "dtype": str(dtype),
                     "model": a.random_weights or str(llm.core.model_path), "device": llm.core.config.device}
    if a.check_requests:
        results["check"] = check_against_hf(llm, hf, [(p, 0) for p, _ in reqs[: a.check_requests]],
                                            a.check_tokens, pad_id)
        print(f"check vs HF: {results['check']}", file=sys.stderr)
    t_engine = run_engine(llm, reqs)
    print(f"engine: {t_engine:.1f} s", file=sys.stderr)
    results["engine_tok_s"] = useful / t_engine
    results["engine_s"] = t_engine
    if spec is not None:
        t_spec = run_engine(spec, reqs)
        print(f"engine + speculation: {t_spec:.1f} s", file=sys.stderr)
        results["spec_tok_s"], results["spec_s"] = useful / t_spec, t_spec
    hf_rows = {}
    for bsz in [int(x) for x in a.hf_batch_sizes.split(",") if x]:
        t = run_hf_batched(hf, reqs, bsz, pad_id)
        print(f"HF batch {bsz}: {t:.1f} s", file=sys.stderr)
        hf_rows[bsz] = {"s": t, "tok_s": useful / t}
    best_bsz = max(hf_rows, key=lambda b: hf_rows[b]["tok_s"])
    results["hf_batched"] = hf_rows
    results["hf_best_batch_size"] = best_bsz
    results["ratio_vs_hf_batched"] = results["engine_tok_s"] / hf_rows[best_bsz]["tok_s"]

    singles = reqs[: a.single_requests]
    hf_dec = eng_dec = spec_dec = 0.0
    dec_tokens = 0
    for p, o in singles:  # the three systems interleaved, so drift hits them alike
        hf_dec += hf_single(hf, p, o, pad_id) - hf_single(hf, p, 1, pad_id)
        eng_dec += engine_single(llm, p, o) - engine_single(llm, p, 1)
        if spec is not None:
            spec_dec += engine_single(spec, p, o) - engine_single(spec, p, 1)
        dec_tokens += o - 1
    if singles:
        results["hf_single_decode_tok_s"] = dec_tokens / hf_dec
        results["engine_single_decode_tok_s"] = dec_tokens / eng_dec
        results["ratio_single_decode"] = hf_dec / eng_dec
    if spec is not None:
        if singles:
            results["spec_single_decode_tok_s"] = dec_tokens / spec_dec
            results["ratio_single_decode_spec"] = hf_dec / spec_dec
        results["spec_draft_tokens"] = spec.core.num_draft_tokens
        results["spec_acceptance"] = 1 - spec.core.num_rejected_tokens / max(1, spec.core.num_draft_tokens)

    rows = [["agentrt engine (continuous batching)", f"{results['engine_s']:.1f}", results["engine_tok_s"], 1.0]]
    if spec is not None:
        rows.append([f"agentrt engine + n-gram speculation (k={a.speculative})", f"{results['spec_s']:.1f}",
                     results["spec_tok_s"], results["spec_tok_s"] / results["engine_tok_s"]])
    for b, r in hf_rows.items():
        rows.append([f"HF generate, batch {b}", f"{r['s']:.1f}", r["tok_s"], r["tok_s"] / results["engine_tok_s"]])
    table = markdown_table(["system", "wall s", "output tok/s", "vs engine"], rows)
    single_note = ""
    if singles:
        single_rows = [["agentrt engine", results["engine_single_decode_tok_s"], results["ratio_single_decode"]]]
        if spec is not None:
            single_rows.append([f"agentrt engine + n-gram speculation (k={a.speculative})",
                                results["spec_single_decode_tok_s"], results["ratio_single_decode_spec"]])
        single_rows.append(["HF generate", results["hf_single_decode_tok_s"], 1.0])
        single = markdown_table(["single request (decode only)", "tok/s", "vs HF"], single_rows)
        single_note = (f"{single}\n\nSingle-request decode, engine / HF: **{results['ratio_single_decode']:.2f}x** "
                       f"(target >= 1.5x; {len(singles)} requests, prefill excluded)\n\n")
    spec_note = (
        f"Speculation: {results['spec_draft_tokens']} drafts over all engine + speculation runs, "
        f"{results['spec_acceptance']:.0%} accepted (drafts are off while more than 8 requests run).\n"
        if spec is not None else ""
    )
    check = results.get("check")
    check_note = (
        f"Same weights, greedy, one request at a time, {check['tokens']} tokens: engine's first token = HF's for "
        f"{check['first_token_match']:.0%} of {check['requests']} requests, all tokens for "
        f"{check['all_tokens_match']:.0%} (mean {check['mean_tokens_before_divergence']:.1f} tokens before the "
        f"first difference).\n" if check else ""
    )
    model_note = f"Model: random weights of {a.random_weights}'s shape. " if a.random_weights else ""
    summary = (
        f"{model_note}{a.num_requests} requests, prompts 16-512, outputs 16-256 ({useful} output tokens), ignore_eos, greedy, "
        f"{dtype}.\n\n{table}\n\nEngine / best HF batched (batch {best_bsz}): **{results['ratio_vs_hf_batched']:.2f}x** "
        f"(target >= 3x)\n\n{single_note}{spec_note}{check_note}"
    )
    if a.json:
        print(json.dumps(results, indent=2))
    else:
        print(summary)
    if not a.no_docs:
        title = "Throughput" if a.random_weights is None else f"Throughput ({a.random_weights}, random weights, {results['device']})"
        write_section(title, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
