"""Throughput: this engine vs HF transformers `generate`, same model, same run.

Workload: N requests (default 64), prompt lengths uniform in [16, 512], output lengths uniform in
[16, 256], ignore_eos, greedy, fixed seed. Measured:
- engine: all requests through `LLM.generate` (continuous batching), in the engine's dtype (default
  "auto": bf16 on CPUs with AVX512-BF16 or AMX, fp32 on other CPUs; the start-up line says which);
- HF batched: left-padded `generate` in batches of 8/16/32/64, in each of `--hf-dtypes` (default: the
  engine's dtype, and fp32 too when that is bf16 on CPU, so the engine meets HF in HF's best dtype);
  a batch decodes until its longest request is done, so only each request's own output tokens count;
- compute: the batched run's model FLOPs (projections per computed token, attention per position
  attended, the LM head per sampled row) per second of its wall time, and the same for a prefill-only
  pass over the same prompts (1 output token each), against a GEMM probe of the same run (torch's
  GEMM 512 x 576 x 1536 in the engine's dtype, the median of 7 timings of 10 calls);
- single request, one at a time, on a subset: decode tokens/s of HF (each dtype), of the engine, and,
  when the engine is not fp32, of the engine in fp32, prefill excluded: HF as (out - 1) /
  (t(out tokens) - t(1 token)); the engines (engine, its fp32 twin, the speculative one) run the same
  request side by side, stepped in turn, each timing its own steps after its first (bursts of
  `--num-scheduler-steps` tokens), so a neighbour's load on a shared machine lands on all of them
  alike (timed one whole request after the other, bf16 / fp32 ratios of the same four requests
  spread 1.48-1.68x on an AVX2 machine, stepped in turn 1.50-1.58x). Each request is timed
  `--single-repeats` times per system, its median kept.
- with `--speculative K` (default 3; 0 = skip), the engine again with n-gram speculative decoding
  (K drafts per step, exact for greedy), reported in separate rows: plain decoding stays the
  headline comparison. Prompts of random token ids make a small model loop, which prompt lookup
  exploits, so these rows show what speculation does on repetitive output, not on natural text.

On a GPU machine without the checkpoint, `--random-weights smollm2-135m|llama-3.1-8b|qwen3-0.6b` builds a
model of that shape with random weights (tokenizer from `--tokenizer`, default: the default
model's); the engine and HF then run the same weights, and a check prints how many of the first
`--check-requests` requests get HF's greedy tokens (first token, and all `--check-tokens`). The mixtures
of experts `qwen3-30b-a3b` and `gpt-oss-20b` take `--layers N` (their first N layers: 4 fit a workstation
beside HF's copy: the engine loads tensor by tensor in its dtype, keeps the experts packed only, and HF shares
its embedding and LM head; the page gives the run's peak RSS). gpt-oss-20b's random experts are written in MXFP4
as the real checkpoint ships them (`--no-mxfp4`: bf16), HF's copy holding the values the blocks stand for, so
both run equal weights; the engine keeps them packed on CPU (`--quantization none` widens them).
`--quantization int8|int4|none|gguf` is passed to every engine row (the start-up line says what is packed).

`--concurrent N` (default 8 for a mixture of experts): the workload's first N requests as N concurrent calls
(one `generate`) against the same N calls one at a time, output tokens/s of each, prefill included. With their
own output lengths (16-256) the concurrent run ends with a tail of one or two calls; `--concurrent-tokens T`
gives every call T output tokens, so all N stay concurrent from the first step to the last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from agentrt.bench._common import dtype_on_cpu, markdown_table, write_section
from agentrt.engine.testing import PRESETS


def workload(n: int, seed: int, vocab_lo: int = 100, vocab_hi: int = 40000):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        p = rng.randint(16, 512)
        o = rng.randint(16, 256)
        reqs.append(([rng.randrange(vocab_lo, vocab_hi) for _ in range(p)], o))
    return reqs


def linear_flops_per_token(args) -> int:
    """Projection FLOPs of one token through all layers (the LM head not included)."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    attn = args.hidden_size * (q + 2 * kv) + q * args.hidden_size
    dense = 3 * args.hidden_size * args.intermediate_size
    if (moe := getattr(args, "moe", None)) is None:
        return 2 * args.num_layers * (attn + dense)
    # a mixture's layer: the router and the top-k experts a token runs (and a shared expert)
    sparse = args.hidden_size * (moe.num_experts + 3 * (moe.top_k * moe.intermediate_size + moe.shared_intermediate_size))
    n_sparse = len(moe.sparse_layers)
    return 2 * (args.num_layers * attn + n_sparse * sparse + (args.num_layers - n_sparse) * dense)


def model_flops(args, reqs) -> float:
    """Useful FLOPs of serving `reqs` [(prompt, output tokens)]: every prompt and output token but the
    last goes through the layers (attention over all positions up to its own), every output token is
    sampled from one LM-head row."""
    attn_per_pos = 4 * args.num_layers * args.num_heads * args.head_dim  # q.k and p.v per attended position
    total = 0.0
    for p, o in reqs:
        n = len(p) + o - 1
        total += n * linear_flops_per_token(args) + attn_per_pos * n * (n + 1) / 2
        total += o * 2 * args.vocab_size * args.hidden_size
    return total


def gemm_probe(dtype: torch.dtype, device: str) -> float:
    """GFLOP/s of torch's GEMM at 512 x 576 x 1536 (x [512, 1536] @ w [576, 1536].T) in `dtype`: the
    median of 7 timings of 10 calls, after a warm-up."""
    x = torch.randn(512, 1536, device=device).to(dtype)
    w = torch.randn(576, 1536, device=device).to(dtype)
    times = []
    for i in range(8):
        t = time.perf_counter()
        for _ in range(10):
            F.linear(x, w)
        if device != "cpu":
            torch.cuda.synchronize()
        if i:
            times.append((time.perf_counter() - t) / 10)
    return 2 * 512 * 576 * 1536 / statistics.median(times) / 1e9


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_flags_note() -> str:
    from agentrt.kernels import cpu

    flags = cpu.cpu_flags()
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16",
                         "amx_tile") if f in flags]
    return f"CPU flags: {' '.join(shown) or 'unknown'} (C++ kernels: {cpu.describe()})"


def share_embeddings(hf, model) -> int:
    """Point HF's token embedding and LM head at the engine's equal tensors (a random-weight run, both loaded
    from one checkpoint; the two largest matrices of a mixture's first layers), so the run holds them once;
    returns the bytes HF let go. The engine's copies are not written (it serves them read-only)."""
    pairs = [(hf.get_input_embeddings(), model.embed_tokens)]
    if model.lm_head is not None and hf.get_output_embeddings() is not None:
        pairs.append((hf.get_output_embeddings(), model.lm_head))
    freed = 0
    for theirs, ours in pairs:
        w, v = theirs.weight, ours.weight
        if w is v or w.shape != v.shape or w.dtype != v.dtype or w.device != v.device or not torch.equal(w, v):
            continue
        freed += w.numel() * w.element_size()
        theirs.weight = v
    return freed


def peak_rss_gib() -> float:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20


def run_engine(llm, reqs) -> float:
    from agentrt.engine import SamplingParams

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
    from agentrt.engine import SamplingParams

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
    from agentrt.engine import SamplingParams

    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    return time.perf_counter() - t


def engines_decode_paired(engines: dict, prompt, new: int) -> dict:
    """Per engine, seconds of its `new - 1` decode steps after one prompt, the engines stepped in turn:
    each engine's next step (a burst of `num_scheduler_steps` tokens) runs right after the others',
    so a neighbour's load on a shared host lands on all of them alike instead of on whichever engine
    ran its whole request in that second. The prompt is in each prefix cache first and each engine's
    first step (the prompt's uncached tail and the first token) is not timed: no engine pays its prefill
    (the prefix cache would otherwise leave the whole prefill in the first run only)."""
    from agentrt.engine import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    for llm in engines.values():
        engine_single(llm, prompt, 1)
    cores = {key: llm.core for key, llm in engines.items()}
    reqs = {key: core.add_request(prompt, params) for key, core in cores.items()}
    try:
        for core in cores.values():
            core.step()
        seconds = dict.fromkeys(cores, 0.0)
        live = [key for key, core in cores.items() if core.has_work()]
        while live:
            for key in list(live):
                t = time.perf_counter()
                cores[key].step()
                seconds[key] += time.perf_counter() - t
                if not cores[key].has_work():
                    live.remove(key)
        for key, core in cores.items():
            got = len(core.finished_output(reqs[key]).outputs[0].token_ids)
            if got != new:
                raise RuntimeError(f"engine {key!r} produced {got} tokens, not {new}")
    finally:
        for key, core in cores.items():
            core.release(reqs[key].request_id)
    return seconds


def concurrency(llm, reqs, repeats: int, prefilled: bool = False) -> dict:
    """Output tokens/s of `reqs` as concurrent calls (one `LLM.generate`, all of them seated together) against
    the same calls one at a time (a `generate` each), same engine, prefill included on both sides (every run's
    prompts get a first token no earlier run used: no prefix-cache hits); the two alternate `repeats` times,
    each side's median kept. `prefilled`: each timed prompt was computed once before (untimed), so a timed call
    reads its full blocks from the prefix cache and computes its last partial block and its output: the decode's
    tokens/s, the part where the concurrent calls share each step's weights."""
    useful = sum(o for _, o in reqs)
    together: list[float] = []
    alone: list[float] = []
    base = 1000 if prefilled else 0  # first tokens the other variant never used
    for r in range(repeats):
        fresh = [([p[0] + base + 3 + 2 * r, *p[1:]], o) for p, o in reqs]
        again = [([p[0] + base + 4 + 2 * r, *p[1:]], o) for p, o in reqs]
        if prefilled:
            run_engine(llm, [(p, 1) for p, _ in fresh + again])
        for side in ("together", "alone") if r % 2 == 0 else ("alone", "together"):
            if side == "together":
                together.append(run_engine(llm, fresh))
            else:
                alone.append(sum(run_engine(llm, [req]) for req in again))
            print(f"concurrency{' (prefilled)' if prefilled else ''} repeat {r} {side}: "
                  f"{(together if side == 'together' else alone)[-1]:.1f} s", file=sys.stderr)
    t_together, t_alone = statistics.median(together), statistics.median(alone)
    return {"calls": len(reqs), "output_tokens": useful, "repeats": repeats, "concurrent_s": t_together,
            "one_at_a_time_s": t_alone, "concurrent_tok_s": useful / t_together, "one_at_a_time_tok_s": useful / t_alone,
            "ratio": t_alone / t_together}


def deterministic_cost(a, kw: dict) -> tuple[dict, str]:
    """The deterministic (batch-invariant) engine, the CPU default, against the batch-variant one
    (`deterministic=False`, `--no-deterministic`), same run, same requests: batched
    output tok/s and a prefill-only pass (the two run in turn, `--repeats` times, each repeat's prompts new to
    both prefix caches), and single-request decode stepped in turn (`engines_decode_paired`). Returns
    (results, the markdown section)."""
    from agentrt.engine import LLM

    kw = {k: v for k, v in kw.items() if k != "deterministic"}
    engines = {"batch-variant": LLM(a.model, **kw, deterministic=False),
               "deterministic": LLM(a.model, **kw, deterministic=True)}
    reqs = workload(a.num_requests, a.seed)
    useful, prompt_tokens = sum(o for _, o in reqs), sum(len(p) for p, _ in reqs)
    for e in engines.values():
        run_engine(e, [(p[:300], 4) for p, _ in reqs[:4]])  # pack the weights, warm both paths
    batched: dict[str, list[float]] = {k: [] for k in engines}
    prefill: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(a.det_repeats):
        fresh = [([p[0] + 1 + 2 * r, *p[1:]], o) for p, o in reqs]  # a first token no earlier run used
        once = [([p[0] + 2 + 2 * r, *p[1:]], 1) for p, _ in reqs]
        for k in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            batched[k].append(useful / run_engine(engines[k], fresh))
            prefill[k].append(prompt_tokens / run_engine(engines[k], once))
            print(f"repeat {r} {k}: {batched[k][-1]:.1f} output tok/s, prefill {prefill[k][-1]:.0f} tok/s",
                  file=sys.stderr)
    singles = reqs[: a.single_requests]
    decode: dict[str, dict[int, list[float]]] = {k: {} for k in engines}
    for _ in range(max(1, a.single_repeats)):
        for j, (p, o) in enumerate(singles):
            for k, seconds in engines_decode_paired(engines, p, o).items():
                decode[k].setdefault(j, []).append(seconds)
    dec_tokens = sum(o - 1 for _, o in singles)
    res = {"dtype": engines["batch-variant"].core.config.dtype, "num_requests": a.num_requests, "output_tokens": useful,
           "startup_lines": {k: e.core.startup_line for k, e in engines.items()},
           "batched_tok_s": {k: statistics.median(v) for k, v in batched.items()},
           "prefill_tok_s": {k: statistics.median(v) for k, v in prefill.items()}}
    if singles:
        res["single_decode_tok_s"] = {k: dec_tokens / sum(statistics.median(ts) for ts in per.values())
                                      for k, per in decode.items()}
    rows = []
    for key, label in (("batched_tok_s", f"batched output tok/s ({a.num_requests} requests)"),
                       ("prefill_tok_s", "prefill-only prompt tok/s (1 output token each)"),
                       ("single_decode_tok_s", f"single-request decode tok/s ({len(singles)} requests, prefill excluded)")):
        if key in res:
            v = res[key]
            res[key.replace("_tok_s", "_cost")] = 1 - v["deterministic"] / v["batch-variant"]
            rows.append([label, v["batch-variant"], v["deterministic"], v["deterministic"] / v["batch-variant"]])
    table = markdown_table(["measure", "batch-variant", "deterministic", "deterministic / batch-variant"], rows)
    costs = ", ".join(f"{name} **{res[key]:+.0%}**" for name, key in
                      (("batched throughput", "batched_cost"), ("single-request decode", "single_decode_cost"))
                      if key in res)
    section = (f"{cpu_flags_note()}. Load average {os.getloadavg()[0]:.1f} at the end.  \n"
               f"Engines: `{res['startup_lines']['deterministic']}`, and the same with `deterministic=False`; "
               f"num_scheduler_steps={a.num_scheduler_steps}\n\n{a.num_requests} requests, prompts 16-512, outputs "
               f"16-256 ({useful} output tokens), ignore_eos, greedy; batched and prefill rows the median of "
               f"{a.det_repeats} runs per engine, run in turn; single-request decode the median of "
               f"{max(1, a.single_repeats)} runs per request, the engines stepped in turn.\n\n{table}\n\n"
               f"Cost of deterministic mode (1 - deterministic / default): {costs} (target <= 10% each).\n")
    return res, section


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench throughput", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--hf-batch-sizes", default="8,16,32,64")
    ap.add_argument("--single-requests", type=int, default=4, help="requests timed one at a time (0 = skip)")
    ap.add_argument("--single-repeats", type=int, default=3,
                    help="times each single request is timed per system, the median kept (systems interleaved)")
    ap.add_argument("--dtype", default=None, help="engine dtype (default: the engine's, \"auto\" on CPU)")
    ap.add_argument("--hf-dtypes", default=None,
                    help="comma-separated dtypes HF runs in, each optionally with its own batch sizes (float32@16+32); "
                         "default: the engine's, plus float32 when that is bf16 on CPU")
    ap.add_argument("--fp32-reference", action=argparse.BooleanOptionalAction, default=None,
                    help="time the engine in fp32 too in the single-request rows (default: when the engine is not fp32)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--num-scheduler-steps", type=int, default=8,
                    help="the engine's decode steps per scheduler call (multi-step decode; every engine row, both dtypes)")
    ap.add_argument("--speculative", type=int, default=3, help="n-gram drafts per step for the extra rows (0 = skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random-weights", default=None, metavar="PRESET",
                    help="random weights of a real shape instead of --model: " + ", ".join(PRESETS))
    ap.add_argument("--layers", type=int, default=None,
                    help="with --random-weights: the preset's first N layers only (e.g. 4 of qwen3-30b-a3b's 48)")
    ap.add_argument("--tokenizer", default=None, help="model directory to take the tokenizer from (--random-weights)")
    ap.add_argument("--mxfp4", action=argparse.BooleanOptionalAction, default=None,
                    help="with --random-weights gpt-oss-20b: its experts written in MXFP4, as the checkpoint ships "
                         "(default: yes for gpt-oss)")
    ap.add_argument("--quantization", default=None, choices=("none", "gguf", "int8", "int4"),
                    help="the engine's --quantization, every engine row (default: the engine's)")
    ap.add_argument("--kv-cache-gb", type=float, default=None, help="engine KV cache size (default: the engine's)")
    ap.add_argument("--check-requests", type=int, default=8, help="requests compared with HF token by token")
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--sampling-steps", type=int, default=8,
                    help="decode steps per run of the sampling-processors row (bench.sampling; 0 = skip)")
    ap.add_argument("--concurrent", type=int, default=None,
                    help="the workload's first N requests as N concurrent calls vs one call at a time, output tok/s of "
                         "each (prefill included; 0 = skip; N <= --max-num-seqs); default 8 for a mixture of experts, "
                         "else 0")
    ap.add_argument("--concurrent-repeats", type=int, default=1, help="alternated runs of each side of --concurrent")
    ap.add_argument("--concurrent-tokens", type=int, default=None,
                    help="output tokens of every --concurrent call (default: each request's own, 16-256)")
    ap.add_argument("--deterministic-cost", action="store_true",
                    help="only the deterministic (batch-invariant) engine against the batch-variant one (no HF)")
    ap.add_argument("--det-repeats", type=int, default=2, help="batched runs per engine with --deterministic-cost")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--docs", action=argparse.BooleanOptionalAction, default=False,
                    help="write this benchmark's section of docs/benchmarks/throughput.md (default: no)")
    a = ap.parse_args(argv)
    if a.concurrent is not None and not 0 <= a.concurrent <= min(a.max_num_seqs, a.num_requests):
        ap.error(f"--concurrent {a.concurrent} must be between 0 and --max-num-seqs ({a.max_num_seqs}) and "
                 f"--num-requests ({a.num_requests}): the calls are the workload's first, all seated at once")
    if a.concurrent_tokens is not None and a.concurrent_tokens < 1:
        ap.error(f"--concurrent-tokens {a.concurrent_tokens} must be >= 1")
    if a.layers is not None and a.random_weights is None:
        ap.error(f"--layers {a.layers} cuts a --random-weights preset; give one ({', '.join(PRESETS)})")
    gpt_oss = a.random_weights is not None and PRESETS.get(a.random_weights, {}).get("model_type") == "gpt_oss"
    if a.mxfp4 and not gpt_oss:
        ap.error(f"--mxfp4 writes gpt-oss's experts as its checkpoint ships them; --random-weights is "
                 f"{a.random_weights!r}")
    mxfp4 = gpt_oss if a.mxfp4 is None else a.mxfp4

    from transformers import AutoModelForCausalLM

    from agentrt.engine import LLM, EngineConfig

    hf = None
    if a.random_weights is not None:
        import atexit
        import shutil
        import tempfile

        from agentrt.engine.testing import make_random_model

        cfg = EngineConfig(dtype=a.dtype)  # the engine's default device and dtype
        a.model = tempfile.mkdtemp(prefix=f"agentrt-{a.random_weights}-")
        atexit.register(shutil.rmtree, a.model, True)
        _, hf = make_random_model(a.model, a.random_weights, dtype=cfg.torch_dtype, device=cfg.device,
                                  seed=a.seed, tokenizer_from=a.tokenizer, num_layers=a.layers, mxfp4_experts=mxfp4)
        if a.layers is not None:
            a.random_weights = f"{a.random_weights} (first {a.layers} layers)"
        if mxfp4:
            a.random_weights += ", MXFP4 experts"
    kw = {"dtype": a.dtype, "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
          "num_scheduler_steps": a.num_scheduler_steps}
    if a.quantization is not None:
        kw["quantization"] = a.quantization
    if a.kv_cache_gb is not None:
        kw["kv_cache_bytes"] = int(a.kv_cache_gb * 2**30)
    if a.deterministic_cost:
        res, section = deterministic_cost(a, kw)
        print(json.dumps(res, indent=2, default=str) if a.json else section)
        if a.docs:
            write_section(f"Deterministic mode ({dtype_on_cpu(getattr(torch, res['dtype']))})", section)
        return 0
    llm = LLM(a.model, **kw)
    if hf is not None:
        print(f"HF shares the engine's embedding and LM head: {share_embeddings(hf, llm.core.model) / 2**30:.2f} GiB "
              "held once", file=sys.stderr)
    config = llm.core.config
    spec = LLM(a.model, num_speculative_tokens=a.speculative, **kw) if a.speculative else None
    dtype, device = config.torch_dtype, config.device
    fp32_ref = a.fp32_reference if a.fp32_reference is not None else dtype != torch.float32
    ref32 = LLM(a.model, **{**kw, "dtype": "float32"}) if fp32_ref and a.single_requests else None
    batch_sizes = [int(x) for x in a.hf_batch_sizes.split(",") if x]
    hf_batch_sizes = {}  # dtype -> HF batch sizes
    if a.hf_dtypes:
        for item in filter(None, a.hf_dtypes.split(",")):
            name, _, sizes = item.partition("@")
            hf_batch_sizes[getattr(torch, name)] = [int(x) for x in sizes.split("+")] if sizes else batch_sizes
    else:
        hf_batch_sizes[dtype] = batch_sizes
        if device == "cpu" and dtype != torch.float32 and hf is None:
            hf_batch_sizes[torch.float32] = batch_sizes
    hf_dtypes = list(hf_batch_sizes)
    hfs = {}
    # an MXFP4 checkpoint: HF widens its experts (no hub kernels on this machine), the values the engine runs
    widen = {}
    if mxfp4:
        from transformers import Mxfp4Config

        widen["quantization_config"] = Mxfp4Config(dequantize=True)
    for d in hf_dtypes:
        model = hf if hf is not None and d == dtype else AutoModelForCausalLM.from_pretrained(
            str(llm.core.model_path), dtype=d, **widen)
        hfs[d] = model.to(device).eval()
    hf = hfs[hf_dtypes[0]]
    pad_id = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    reqs = workload(a.num_requests, a.seed)
    useful = sum(o for _, o in reqs)
    args = llm.core.model.args

    warm = workload(2, a.seed + 1)
    for e in (llm, spec, ref32):
        if e is not None:
            run_engine(e, [(p[:32], 4) for p, _ in warm])
            run_engine(e, [(p[:300], 4) for p, _ in reqs[:4]])  # pack the weights, warm the prefill path
    for model in hfs.values():
        run_hf_batched(model, [(p[:32], 4) for p, _ in warm], 2, pad_id)

    results: dict = {"num_requests": a.num_requests, "output_tokens": useful, "dtype": str(dtype),
                     "num_scheduler_steps": a.num_scheduler_steps,
                     "dtype_reason": config.dtype_reason, "model": a.random_weights or str(llm.core.model_path),
                     "device": device, "startup_line": llm.core.startup_line,
                     "load_average_start": os.getloadavg()[0]}
    if device == "cpu":
        results["cpu"] = cpu_flags_note()
    if a.check_requests:
        results["check"] = check_against_hf(llm, hf, [(p, 0) for p, _ in reqs[: a.check_requests]],
                                            a.check_tokens, pad_id)
        print(f"check vs HF: {results['check']}", file=sys.stderr)
    probes = [gemm_probe(dtype, device)]
    t_engine = run_engine(llm, reqs)
    print(f"engine: {t_engine:.1f} s", file=sys.stderr)
    results["engine_tok_s"] = useful / t_engine
    results["engine_s"] = t_engine
    results["engine_gflop_s"] = model_flops(args, reqs) / t_engine / 1e9
    prefill_reqs = [([p[0] + 1, *p[1:]], 1) for p, _ in reqs]  # new first token: no prefix-cache hits
    t_prefill = run_engine(llm, prefill_reqs)
    probes.append(gemm_probe(dtype, device))
    results["prefill_tok_s"] = sum(len(p) for p, _ in reqs) / t_prefill
    results["prefill_gflop_s"] = model_flops(args, prefill_reqs) / t_prefill / 1e9
    results["gemm_probe_gflop_s"] = probes
    results["prefill_vs_probe"] = results["prefill_gflop_s"] / statistics.mean(probes)
    print(f"prefill: {t_prefill:.1f} s, {results['prefill_gflop_s']:.0f} GFLOP/s; GEMM probe {probes}", file=sys.stderr)
    if spec is not None:
        t_spec = run_engine(spec, reqs)
        print(f"engine + speculation: {t_spec:.1f} s", file=sys.stderr)
        results["spec_tok_s"], results["spec_s"] = useful / t_spec, t_spec
    hf_rows = {}  # "dtype, batch B" -> {"s", "tok_s"}
    by_dtype: dict[str, dict[int, dict]] = {}
    for d, model in hfs.items():
        for bsz in hf_batch_sizes[d]:
            t = run_hf_batched(model, reqs, bsz, pad_id)
            print(f"HF {d} batch {bsz}: {t:.1f} s", file=sys.stderr)
            hf_rows[f"{_name(d)}, batch {bsz}"] = by_dtype.setdefault(_name(d), {})[bsz] = {"s": t, "tok_s": useful / t}
    best_hf = max(hf_rows, key=lambda k: hf_rows[k]["tok_s"])
    results["hf_batched"] = by_dtype[_name(hf_dtypes[0])]  # HF in the engine's dtype, by batch size
    results["hf_batched_by_dtype"] = by_dtype
    results["hf_best"] = best_hf
    results["ratio_vs_hf_batched"] = results["engine_tok_s"] / hf_rows[best_hf]["tok_s"]

    singles = reqs[: a.single_requests]
    # system -> per request, its decode seconds in each repeat; the systems interleaved within a
    # repeat, so drift hits them alike, and each request's median over the repeats kept
    runs: dict = {}
    for _ in range(max(1, a.single_repeats)):
        for j, (p, o) in enumerate(singles):
            for d, model in hfs.items():
                runs.setdefault(d, {}).setdefault(j, []).append(
                    hf_single(model, p, o, pad_id) - hf_single(model, p, 1, pad_id))
            engines = {key: e for key, e in (("engine", llm), ("fp32", ref32), ("spec", spec)) if e is not None}
            for key, seconds in engines_decode_paired(engines, p, o).items():
                runs.setdefault(key, {}).setdefault(j, []).append(seconds)
    median_sum = {k: sum(statistics.median(ts) for ts in per_req.values()) for k, per_req in runs.items()}
    hf_dec = {d: median_sum[d] for d in hfs} if singles else dict.fromkeys(hfs, 0.0)
    eng_dec, ref_dec, spec_dec = (median_sum.get(k, 0.0) for k in ("engine", "fp32", "spec"))
    dec_tokens = sum(o - 1 for _, o in singles)
    if singles:
        results["hf_single_decode_tok_s"] = dec_tokens / hf_dec[hf_dtypes[0]]  # HF in the engine's dtype
        results["hf_single_decode_tok_s_by_dtype"] = {_name(d): dec_tokens / t for d, t in hf_dec.items()}
        best_hf_dec = min(hf_dec.values())
        results["engine_single_decode_tok_s"] = dec_tokens / eng_dec
        results["ratio_single_decode"] = best_hf_dec / eng_dec
        if ref32 is not None:
            results["engine_fp32_single_decode_tok_s"] = dec_tokens / ref_dec
            results["ratio_single_decode_vs_fp32"] = ref_dec / eng_dec
    if spec is not None:
        if singles:
            results["spec_single_decode_tok_s"] = dec_tokens / spec_dec
            results["ratio_single_decode_spec"] = best_hf_dec / spec_dec
        results["spec_draft_tokens"] = spec.core.num_draft_tokens
        results["spec_acceptance"] = 1 - spec.core.num_rejected_tokens / max(1, spec.core.num_draft_tokens)
    concurrency_note = ""
    if a.concurrent is None:
        a.concurrent = min(8, a.max_num_seqs, a.num_requests) if getattr(args, "moe", None) is not None else 0
    if a.concurrent:
        calls = [(p, a.concurrent_tokens or o) for p, o in reqs[: a.concurrent]]
        c = results["concurrency"] = concurrency(llm, calls, max(1, a.concurrent_repeats))
        cd = results["concurrency_decode"] = concurrency(llm, calls, max(1, a.concurrent_repeats), prefilled=True)
        c["output_lengths"] = (f"{a.concurrent_tokens} output tokens each: all {len(calls)} concurrent to the end"
                               if a.concurrent_tokens else "their own output lengths")
        crows = [[f"{x['calls']} concurrent calls (one generate), {what}", f"{x['concurrent_s']:.1f}",
                  x["concurrent_tok_s"], x["ratio"]] for x, what in ((c, "prefill included"), (cd, "prompts prefilled"))]
        crows += [[f"the same {c['calls']} calls one at a time, {what}", f"{x['one_at_a_time_s']:.1f}",
                   x["one_at_a_time_tok_s"], 1.0] for x, what in ((c, "prefill included"), (cd, "prompts prefilled"))]
        target = " (target >= 4x for a mixture of experts)" if getattr(args, "moe", None) is not None else ""
        concurrency_note = (
            f"{markdown_table(['engine calls', 'wall s', 'output tok/s', 'vs one at a time'], crows)}\n\n"
            f"{c['calls']} concurrent calls / one call at a time, output tok/s: **{c['ratio']:.2f}x** prefill included, "
            f"**{cd['ratio']:.2f}x** with the prompts prefilled (decode){target}; the "
            f"workload's first {c['calls']} requests, {c['output_lengths']} ({c['output_tokens']} output tokens); "
            "prefill included: every prompt new to the cache; prompts prefilled: each computed once before, untimed, so "
            "a timed call computes its last partial block and its output; the median of "
            f"{c['repeats']} alternated runs each\n\n")
    sampling_note = ""
    if a.sampling_steps > 0:
        from agentrt.bench import sampling

        config.num_scheduler_steps = 1  # processors against plain single steps (a plain batch would run bursts)
        # 32 running rows, or as many as the engine seats (--max-num-seqs 8: the MoE runs' 8 concurrent calls)
        results["sampling"] = sampling.measure(llm, min(32, config.max_num_seqs), a.sampling_steps, 3, seed=a.seed)
        config.num_scheduler_steps = a.num_scheduler_steps
        print(f"sampling processors: {results['sampling']['overhead']}", file=sys.stderr)
        sampling_note = f"{sampling.table(results['sampling'])}\n\n"
    results["load_average_end"] = os.getloadavg()[0]
    results["peak_rss_gib"] = peak_rss_gib()

    name = _name(dtype)
    rows = [[f"agentrt engine (continuous batching), {name}", f"{results['engine_s']:.1f}", results["engine_tok_s"], 1.0]]
    if spec is not None:
        rows.append([f"agentrt engine + n-gram speculation (k={a.speculative})", f"{results['spec_s']:.1f}",
                     results["spec_tok_s"], results["spec_tok_s"] / results["engine_tok_s"]])
    for k, r in hf_rows.items():
        rows.append([f"HF generate, {k}", f"{r['s']:.1f}", r["tok_s"], r["tok_s"] / results["engine_tok_s"]])
    table = markdown_table(["system", "wall s", "output tok/s", "vs engine"], rows)
    single_note = ""
    if singles:
        single_rows = [[f"agentrt engine, {name}", results["engine_single_decode_tok_s"],
                        results["ratio_single_decode"]]]
        if ref32 is not None:
            single_rows.append(["agentrt engine, float32", results["engine_fp32_single_decode_tok_s"],
                                best_hf_dec / ref_dec])
        if spec is not None:
            single_rows.append([f"agentrt engine + n-gram speculation (k={a.speculative})",
                                results["spec_single_decode_tok_s"], results["ratio_single_decode_spec"]])
        for d, t in hf_dec.items():
            single_rows.append([f"HF generate, {_name(d)}", dec_tokens / t, best_hf_dec / t])
        single = markdown_table(["single request (decode only)", "tok/s", "vs best HF"], single_rows)
        vs32 = (f"; engine {name} / engine float32: **{results['ratio_single_decode_vs_fp32']:.2f}x** (target >= 1.8x)"
                if ref32 is not None else "")
        single_note = (f"{single}\n\nSingle-request decode, engine / best HF: **{results['ratio_single_decode']:.2f}x** "
                       f"(target >= 2x){vs32}; {len(singles)} requests, each the median of {max(1, a.single_repeats)} runs per "
                       "system (systems interleaved; the engines side by side, stepped in turn), prefill excluded\n\n")
    compute_note = (
        f"Compute: the batched run above did {results['engine_gflop_s']:.0f} GFLOP/s of model work; a prefill-only "
        f"pass over the same {a.num_requests} prompts (1 output token each) {results['prefill_tok_s']:.0f} tok/s = "
        f"{results['prefill_gflop_s']:.0f} GFLOP/s, **{results['prefill_vs_probe']:.0%}** of the GEMM probe "
        f"(torch GEMM 512 x 576 x 1536 in {name}: {probes[0]:.0f} GFLOP/s before the batched run, {probes[1]:.0f} "
        f"after the prefill pass; target >= 50%).\n\n"
    )
    spec_note = (
        f"Speculation: {results['spec_draft_tokens']} drafts over all engine + speculation runs, "
        f"{results['spec_acceptance']:.0%} accepted (drafts are off while more than 8 requests run).\n\n"
        if spec is not None else ""
    )
    check = results.get("check")
    check_note = (
        f"Same weights, greedy, one request at a time, {check['tokens']} tokens: engine's first token = HF's "
        f"({_name(hf_dtypes[0])}) for {check['first_token_match']:.0%} of {check['requests']} "
        f"requests, all tokens for {check['all_tokens_match']:.0%} (mean {check['mean_tokens_before_divergence']:.1f} "
        f"tokens before the first difference).\n\n" if check else ""
    )
    model_note = f"Model: random weights of {a.random_weights}'s shape. " if a.random_weights else ""
    machine_note = (f"{results['cpu']}. Load average {results['load_average_start']:.1f} at the start, "
                    f"{results['load_average_end']:.1f} at the end; peak RSS {results['peak_rss_gib']:.1f} GiB (engine "
                    f"and HF together).  \n" if device == "cpu" else "")
    summary = (
        f"{machine_note}Engine: `{llm.core.startup_line}`; every engine row with num_scheduler_steps="
        f"{a.num_scheduler_steps} (greedy decode steps per scheduler call), the float32 one too\n\n"
        f"{model_note}{a.num_requests} requests, prompts 16-512, outputs 16-256 ({useful} output tokens), ignore_eos, "
        f"greedy.\n\n{table}\n\nEngine / best HF batched ({best_hf}): **{results['ratio_vs_hf_batched']:.2f}x** "
        f"(target >= 3x)\n\n{compute_note}{single_note}{concurrency_note}{spec_note}{sampling_note}{check_note}"
    )
    if a.json:
        print(json.dumps(results, indent=2, default=str))
    else:
        print(summary)
    if a.docs:
        if a.random_weights is not None:
            parts = [a.random_weights, "random weights", results["device"]]
        else:  # a model other than the default one named first
            parts = (([os.path.basename(str(a.model).rstrip("/"))] if a.model is not None else [])
                     + ([dtype_on_cpu(dtype)] if device == "cpu" else []))
        if a.quantization not in (None, "none"):  # its own section: a packed run does not replace the widened one
            parts.append(f"--quantization {a.quantization}")
        title = f"Throughput ({', '.join(parts)})" if parts else "Throughput"
        write_section(title, summary)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
