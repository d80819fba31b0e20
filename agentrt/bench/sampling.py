"""Sampling processors: what every processor on costs a decode step, against the plain step.

    agentrt bench sampling [--running 32] [--steps 16] [--repeats 3] [--json] [--docs]

`--running` requests (prompts of 128 random token ids, ignore_eos) are prefilled, then `--steps`
decode steps are timed with every request plain (greedy, the throughput benchmark's setting) and
with every processor on (temperature 0.8, top_k 50, top_p 0.95, min_p 0.05, presence 0.5,
frequency 0.5, repetition 1.1, min_tokens, logit_bias on 3 tokens), A/B interleaved `--repeats`
times on one engine. The forward is the same in both, so the overhead is the extra time spent
sampling (the runner's `sample`, `_context` and `_top_lists`, timed by wrapping them) divided by
the plain step (the runner's step time: input prep, forward, sampling), medians over repeats; the
whole-step ratio is reported too, but on a shared CPU its noise is larger than the effect. Also
reported: every processor plus top-5 logprobs.
`agentrt bench throughput` prints the same row. Writes its docs/benchmarks/sampling.md section only with
`--docs`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from agentrt.bench._common import dtype_on_cpu, markdown_table, write_section

DOCS_SECTION = "Sampling processors ({where})"  # one section per dtype and CPU kind (or device)


def configs(max_tokens: int) -> dict[str, object]:
    from agentrt.engine import SamplingParams

    every = dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5,
                 repetition_penalty=1.1, min_tokens=max_tokens // 2, logit_bias={100: 1.0, 200: -1.0, 300: 2.0})
    return {
        "plain (greedy)": SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        "every processor": SamplingParams(max_tokens=max_tokens, ignore_eos=True, **every),
        "every processor + top-5 logprobs": SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=True,
                                                           top_logprobs=5, **every),
    }


class _SamplerClock:
    """Time spent in the runner's sampling functions (wrapped while the benchmark runs)."""

    NAMES = ("sample", "_context", "_top_lists")

    def __init__(self) -> None:
        import agentrt.engine.runner as runner

        self.runner, self.total_s, self.orig = runner, 0.0, {}
        for name in self.NAMES:
            self.orig[name] = fn = getattr(runner, name)
            setattr(runner, name, self._timed(fn))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total_s += time.perf_counter() - t

        return timed

    def close(self) -> None:
        for name, fn in self.orig.items():
            setattr(self.runner, name, fn)


def decode_steps(llm, params, running: int, steps: int, prompt_len: int, seed: int, clock: _SamplerClock):
    """(mean runner step time, mean sampling time) of `steps` decode steps with `running` requests."""
    core = llm.core
    rng = random.Random(seed)
    reqs = [core.add_request([rng.randrange(100, 40000) for _ in range(prompt_len)], params) for _ in range(running)]
    while any(r.num_output_tokens == 0 for r in reqs):  # prefill (and first tokens)
        core.step()
    t0, s0 = core.busy_s, clock.total_s
    for _ in range(steps):
        core.step()
    assert all(not r.finished for r in reqs) and len(core.scheduler.running) == running
    step, sampling = (core.busy_s - t0) / steps, (clock.total_s - s0) / steps
    for r in reqs:
        core.release(r.request_id)
    return step, sampling


def measure(llm, running: int = 32, steps: int = 16, repeats: int = 3, prompt_len: int = 128, seed: int = 0) -> dict:
    """Per-step times (s) of each config, A/B interleaved; overhead of each vs the plain step."""
    cfgs = configs(max_tokens=steps + 8)
    times: dict[str, list[float]] = {name: [] for name in cfgs}
    sampling: dict[str, list[float]] = {name: [] for name in cfgs}
    clock = _SamplerClock()
    try:
        decode_steps(llm, cfgs["every processor"], running, 2, prompt_len, seed, clock)  # warm-up
        for rep in range(repeats):
            for name, p in cfgs.items():
                step, samp = decode_steps(llm, p, running, steps, prompt_len, seed + rep, clock)
                times[name].append(step)
                sampling[name].append(samp)
    finally:
        clock.close()
    plain, plain_sampling = times["plain (greedy)"], sampling["plain (greedy)"]
    out = {"running": running, "steps": steps, "repeats": repeats, "step_s": times, "sampling_s": sampling,
           "load_average": os.getloadavg()[0]}
    out["overhead"] = {name: statistics.median((s - s0) / b for s, s0, b in zip(ss, plain_sampling, plain))
                       for name, ss in sampling.items() if name != "plain (greedy)"}
    out["step_ratio"] = {name: statistics.median(t / b for t, b in zip(ts, plain)) - 1
                         for name, ts in times.items() if name != "plain (greedy)"}
    return out


def table(res: dict) -> str:
    plain = statistics.median(res["step_s"]["plain (greedy)"])
    rows = []
    for name, ts in res["step_s"].items():
        over, ratio = res["overhead"].get(name), res["step_ratio"].get(name)
        rows.append([name, f"{statistics.median(res['sampling_s'][name]) * 1e3:.2f}",
                     "-" if over is None else f"{over:+.1%}", f"{statistics.median(ts) * 1e3:.1f}",
                     "-" if ratio is None else f"{ratio:+.1%}"])
    return (markdown_table([f"sampling ({res['running']} running requests)", "sampling ms / step",
                            "overhead vs plain step", "whole step ms", "whole step vs plain"], rows)
            + f"\n\nOverhead: (sampling time - plain sampling time) / plain step time, median over "
            f"{res['repeats']} A/B repeats of {res['steps']} decode steps; plain step {plain * 1e3:.1f} ms; load "
            f"average {res['load_average']:.1f} (the whole-step columns carry that load's noise). Target: every "
            f"processor <= +5%.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench sampling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--running", type=int, default=32, help="requests decoding together")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per run")
    ap.add_argument("--repeats", type=int, default=3, help="A/B repeats")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--docs", action="store_true",
                    help="write this machine's section of docs/benchmarks/sampling.md (one per dtype and CPU kind)")
    a = ap.parse_args(argv)
    for name in ("running", "steps", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    from agentrt.engine import LLM

    llm = LLM(a.model, max_num_seqs=max(64, a.running))
    res = measure(llm, a.running, a.steps, a.repeats, seed=a.seed)
    print(json.dumps(res, indent=2) if a.json else table(res))
    if a.docs:
        config = llm.core.config
        where = (dtype_on_cpu(config.torch_dtype) if config.device == "cpu"
                 else f"{str(config.torch_dtype).removeprefix('torch.')}, {config.device}")
        write_section(DOCS_SECTION.format(where=where), f"Engine: `{llm.core.startup_line}`\n\n{table(res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
