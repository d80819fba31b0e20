"""GGUF weights kept packed vs widened: resident memory and decode tokens/s on the same file (issue 50).

Run as `agentrt bench quant [--model FILE.gguf] [--threads 2] [--json] [--docs]`. Each mode runs in its own
process (so that each peak RSS is its own), on the same GGUF file, the same threads and the same CPU kind
(`AGENTRT_CPU_ISA=avx2` to force the AVX2 kernels):
- `packed`: `quantization="gguf"`, the file's blocks run by kernels.quant (engine.gguf_weights);
- `widened`: `quantization="none"`, the weights widened to the engine's dtype at load, as before;
- `int8` / `int4`: `quantization="int8" | "int4"`, the widened checkpoint quantized at load to Q8_0 / Q4_1 blocks
  of 32 (engine.gguf_weights.quantize_model; what a safetensors model gets);
- `llama.cpp`: the issue's peer, `llama-cpp-python` run by another interpreter (`--llama-python`, a venv where
  it is installed: a benchmark-only peer built from its sdist, never a dependency of agentrt or of CI), on the
  same file and threads; the row is left out, with the reason under the table, where that interpreter cannot
  import `llama_cpp`.

Reported per mode: the weights line of the engine's start-up, resident memory after load and its peak
through the run (`LLM` with a `--kv-mib` KV pool), single-stream decode tokens/s (one prompt, `--max-tokens`
greedy tokens, EOS ignored, best of `--repeats`) and batched output tokens/s (`--concurrency` prompts at
once). llama.cpp runs through llama-cpp-python's bindings of its C API: one context with `--concurrency`
sequences, every sequence's prompt in one batch and then one token of each per `llama_decode` (its batched
decode, as llama-server runs parallel slots), greedy by argmax, EOS ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

DOCS_SECTION = "Packed vs widened GGUF weights"
MODES = {"packed": "gguf", "widened": "none", "int8": "int8", "int4": "int4"}


def _rss_mb() -> tuple[float, float]:
    """(current, peak) resident memory of this process in MB."""
    import resource

    with open("/proc/self/status") as f:
        now = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
    return now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_one(mode: str, model: str | None, threads: int, kv_mib: int, prompt_len: int, max_tokens: int,
                concurrency: int, repeats: int, deterministic: bool | None = None) -> dict:
    """One mode in this process (called in a child by `measure`)."""
    import random

    import torch

    torch.set_num_threads(threads)
    from agentrt.engine import LLM, SamplingParams
    from agentrt.kernels import cpu

    llm = LLM(model, quantization=MODES[mode], kv_cache_bytes=kv_mib << 20, device="cpu", deterministic=deterministic)
    loaded, _ = _rss_mb()
    core = llm.core
    rng = random.Random(0)
    vocab = core.model.args.vocab_size
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate([[rng.randrange(100, vocab) for _ in range(8)]], SamplingParams(max_tokens=4), progress=False)

    def tok_s(n: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(n)]
            t0 = time.perf_counter()
            llm.generate(prompts, sp, progress=False)
            best = min(best, time.perf_counter() - t0)
        return n * max_tokens / best

    single, batched = tok_s(1), tok_s(concurrency)
    now, peak = _rss_mb()
    packed = core.model.packed_weights
    return {"mode": mode, "weights": packed.describe() if packed is not None else f"widened to {core.config.dtype}",
            "dtype": core.config.dtype, "cpu_kind": cpu.compiled_isa() or "torch", "threads": threads,
            "rss_loaded_mb": loaded, "rss_end_mb": now, "rss_peak_mb": peak, "single_tok_s": single,
            "batched_tok_s": batched, "deterministic": core.config.deterministic}


# Run by the peer's interpreter (no agentrt, no torch there): argv[1] is a JSON object of the run's settings; prints
# one JSON line of the same fields as measure_one.
_LLAMA_CHILD = r"""
import ctypes, json, random, resource, sys, time
import numpy as np
import llama_cpp
a = json.loads(sys.argv[1])
P, T, C = a["prompt_len"], a["max_tokens"], a["concurrency"]
_quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)
llama_cpp.llama_log_set(_quiet, ctypes.c_void_p())
def rss():
    with open("/proc/self/status") as f:
        now = next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
    return now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
llama_cpp.llama_backend_init()
mp = llama_cpp.llama_model_default_params()
mp.use_extra_bufts = a["extra_bufts"]
model = llama_cpp.llama_model_load_from_file(a["model"].encode(), mp)
vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
cp = llama_cpp.llama_context_default_params()
cp.n_ctx, cp.n_seq_max, cp.kv_unified = C * (P + T + 8), C, True
cp.n_batch = cp.n_ubatch = max(C * P, 512)
cp.n_threads = cp.n_threads_batch = a["threads"]
ctx = llama_cpp.llama_init_from_model(model, cp)
batch = llama_cpp.llama_batch_init(C * P, 0, C)
loaded, _ = rss()
def put(i, tok, pos, seq, logits):
    batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, logits
    batch.seq_id[i][0] = seq
def run(prompts):  # greedy, EOS ignored: every sequence in one batch per step (llama.cpp's batched decode)
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    n, lens, rows = 0, [len(p) for p in prompts], []
    batch.n_tokens = 0
    for s, p in enumerate(prompts):
        for j, t in enumerate(p):
            put(batch.n_tokens, t, j, s, j == len(p) - 1)
            batch.n_tokens += 1
        rows.append(batch.n_tokens - 1)
    for _ in range(T):
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        nxt = [int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, r), shape=(vocab,)))) for r in rows]
        n += len(prompts)
        for s, t in enumerate(nxt):
            put(s, t, lens[s], s, True)
            lens[s] += 1
        batch.n_tokens, rows = len(prompts), list(range(len(prompts)))
    return n
rng = random.Random(0)
run([[rng.randrange(100, vocab) for _ in range(8)]])
def tok_s(n):
    best = float("inf")
    for _ in range(a["repeats"]):
        prompts = [[rng.randrange(100, vocab) for _ in range(P)] for _ in range(n)]
        t0 = time.perf_counter()
        got = run(prompts)
        best = min(best, time.perf_counter() - t0)
    assert got == n * T, got
    return n * T / best
single, batched = tok_s(1), tok_s(C)
now, peak = rss()
extra = "" if a["extra_bufts"] else ", extra buffer types off (AMX, repack)"
print(json.dumps({"mode": "llama.cpp", "weights": "llama-cpp-python " + llama_cpp.__version__ + ", mmap" + extra,
                  "dtype": "-", "cpu_kind": "llama.cpp", "threads": a["threads"], "rss_loaded_mb": loaded,
                  "rss_end_mb": now, "rss_peak_mb": peak, "single_tok_s": single, "batched_tok_s": batched}))
"""


def llama_cpp_missing(python: str | None) -> str | None:
    """Why the llama.cpp row cannot run with interpreter `python` (None: it can)."""
    if not python:
        return "no --llama-python given (a python where `llama-cpp-python` is installed)"
    try:
        out = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"--llama-python {python!r} cannot run: {e}"
    if out.returncode != 0:
        return f"--llama-python {python!r} cannot import llama_cpp ({(out.stderr.strip().splitlines() or ['?'])[-1]})"
    return None


def measure_llama_cpp(python: str, model: str, threads: int, prompt_len: int, max_tokens: int, concurrency: int,
                      repeats: int) -> dict:
    """The peer's row: `_LLAMA_CHILD` run by `python` on the same file and threads. Where it dies of a segmentation
    fault it runs again without llama.cpp's extra buffer types (`use_extra_bufts`: the AMX and repacked layouts), and
    the row says so: llama-cpp-python 0.3.36's AMX buffer type crashed in its first `llama_decode` on a 2-core Xeon VM
    with AMX (the high-level `Llama` API too), while the plain CPU buffers ran."""
    args = {"model": model, "threads": threads, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "concurrency": concurrency, "repeats": repeats, "extra_bufts": True}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([python, "-c", _LLAMA_CHILD, json.dumps(args)], capture_output=True, text=True, env=env)
    if out.returncode == -signal.SIGSEGV:
        args["extra_bufts"] = False
        out = subprocess.run([python, "-c", _LLAMA_CHILD, json.dumps(args)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"bench quant: the llama.cpp run failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(model: str | None, threads: int, kv_mib: int, prompt_len: int, max_tokens: int, concurrency: int,
            repeats: int, deterministic: bool | None = None, llama_python: str | None = None,
            modes: tuple[str, ...] = tuple(MODES)) -> dict:
    """Each of `modes`, each in a child process; the llama.cpp row where `llama_python` imports llama_cpp."""
    runs = []
    for mode in modes:
        cmd = [sys.executable, "-m", "agentrt.bench.quant", "--one", mode, "--threads", str(threads), "--kv-mib",
               str(kv_mib), "--prompt-len", str(prompt_len), "--max-tokens", str(max_tokens), "--concurrency",
               str(concurrency), "--repeats", str(repeats)] + (["--model", model] if model else []) + (
                   [] if deterministic is None else ["--deterministic" if deterministic else "--no-deterministic"])
        out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        if out.returncode != 0:
            raise RuntimeError(f"bench quant: the {mode} run failed: {out.stderr.strip().splitlines()[-1:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    llama_skipped = llama_cpp_missing(llama_python)
    if llama_skipped is None:
        from agentrt.engine.loader import default_gguf_path

        runs.append(measure_llama_cpp(llama_python, model or str(default_gguf_path()), threads, prompt_len,
                                      max_tokens, concurrency, repeats))
    return {"model": model or "SmolLM2-135M-Instruct (Q4_1 GGUF)", "prompt_len": prompt_len, "max_tokens": max_tokens,
            "concurrency": concurrency, "kv_mib": kv_mib, "repeats": repeats, "runs": runs,
            "llama_cpp_skipped": llama_skipped, "isa_env": os.environ.get("AGENTRT_CPU_ISA"),
            "deterministic": deterministic}


def markdown(result: dict) -> str:
    from agentrt.bench._common import markdown_table

    base = next(r for r in result["runs"] if r["mode"] == "widened")
    peer = next((r for r in result["runs"] if r["mode"] == "llama.cpp"), None)
    forced = f" `AGENTRT_CPU_ISA={result['isa_env']}`." if result.get("isa_env") else ""
    if result.get("deterministic") is not None:
        flag = "--deterministic" if result["deterministic"] else "--no-deterministic"
        forced += f" Engine's deterministic mode {'on' if result['deterministic'] else 'off'} (`{flag}`)."
    headers = ["mode", "weights", "CPU kind", "threads", "RSS loaded MB", "RSS peak MB", "single tok/s", "vs widened",
               "batched tok/s", "vs widened"] + (["single vs llama.cpp", "batched vs llama.cpp"] if peer else [])
    rows = []
    for r in result["runs"]:
        row = [r["mode"], r["weights"], r["cpu_kind"], r["threads"], f"{r['rss_loaded_mb']:,.0f}",
               f"{r['rss_peak_mb']:,.0f}", f"{r['single_tok_s']:,.1f}", f"{r['single_tok_s'] / base['single_tok_s']:.2f}x",
               f"{r['batched_tok_s']:,.1f}",
               f"{r['batched_tok_s'] / base['batched_tok_s']:.2f}x"]
        if peer:
            row += [f"{r['single_tok_s'] / peer['single_tok_s']:.2f}x", f"{r['batched_tok_s'] / peer['batched_tok_s']:.2f}x"]
        rows.append(row)
    return "\n".join([
        (f"Model: {result['model']}; `LLM` with a {result['kv_mib']} MiB KV pool; single stream: one "
         f"{result['prompt_len']}-token random prompt, {result['max_tokens']} greedy tokens; batched: "
         f"{result['concurrency']} such prompts at once; best of {result['repeats']}. Each mode in its own process.{forced}"),
        "",
        markdown_table(headers, rows),
        "",
        _llama_line(result),
    ]) + "\n"


def _llama_line(result: dict) -> str:
    if result.get("llama_cpp_skipped"):
        return f"llama.cpp row left out: {result['llama_cpp_skipped']}."
    if not any(r["mode"] == "llama.cpp" for r in result["runs"]):
        return "llama.cpp (`llama-cpp-python`, the issue's peer on the same file and threads) is not measured yet."
    return ("llama.cpp: `llama-cpp-python` (built from its sdist in a separate venv, `--llama-python`), same file "
            "and threads, weights mapped from the file; batched: all sequences in one `llama_decode` per step.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench quant", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M-Instruct's Q4_1)")
    ap.add_argument("--threads", type=int, default=2, help="torch / kernel threads of each run")
    ap.add_argument("--kv-mib", type=int, default=64, help="the KV pool of each run, MiB")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32, help="prompts of the batched workload")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--llama-python", default=None,
                    help="a python where llama-cpp-python is installed (e.g. /work/llamacpp/bin/python): adds the "
                         "llama.cpp row; without it the row is left out, saying why")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"the agentrt modes to run, comma-separated (default: all: {','.join(MODES)}; widened is "
                         "the table's reference and always runs)")
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                    help="the engine's deterministic (batch-invariant) mode in every agentrt run (default: the "
                         "engine's default, on for CPU)")
    ap.add_argument("--one", choices=sorted(MODES), default=None, help=argparse.SUPPRESS)  # a child's mode
    ap.add_argument("--json", action="store_true", help="print JSON instead of the markdown table")
    ap.add_argument("--docs", action=argparse.BooleanOptionalAction, default=False,
                    help=f"write the '{DOCS_SECTION}' section of docs/benchmarks/quant.md (default: no)")
    a = ap.parse_args(argv)
    for name in ("threads", "kv_mib", "prompt_len", "max_tokens", "concurrency", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.model is not None and not a.model.endswith(".gguf"):
        ap.error(f"--model must be a .gguf file (packed vs widened compares one GGUF file), got {a.model!r}")
    modes = tuple(m for m in a.modes.split(",") if m)
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: unknown mode {bad[0]!r} (modes: {', '.join(MODES)})")
    if "widened" not in modes:
        modes = (*modes, "widened")
    args = (a.model, a.threads, a.kv_mib, a.prompt_len, a.max_tokens, a.concurrency, a.repeats, a.deterministic)
    if a.one is not None:
        print(json.dumps(measure_one(a.one, *args)))
        return 0
    result = measure(*args, llama_python=a.llama_python, modes=modes)
    print(json.dumps(result, indent=2) if a.json else markdown(result))
    if a.docs:
        from agentrt.bench._common import write_section

        # another file's run, and a forced CPU kind's, is a section of its own
        title = DOCS_SECTION if a.model is None else f"{DOCS_SECTION}: {os.path.basename(a.model)}"
        isa = result.get("isa_env")
        write_section(title if not isa else f"{title} (AGENTRT_CPU_ISA={isa})", markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
