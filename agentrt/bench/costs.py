"""Step-cost models of the simulator: a linear model per step, fitted on this machine or named.

A step that schedules `T` tokens for `R` requests takes

    step_s = base_s + token_s * T + decode_row_s * D + context_s * C + prefill_attn_s * A + sample_s * S
             + shared_context_s * H

seconds, where D is the rows decoding one token, C the context tokens the step attends over (every row's
computed tokens plus its new ones) in KV blocks no earlier row of the step reads, H the rest of the context:
tokens in blocks an earlier row of the step reads too (parallel calls of one program over their shared
prefix: the first row brings a block from memory, the others find it in the cache), A the (query, key)
pairs of prefill chunks (attention work that grows with the chunk times its context) and S the rows that
sample a token (the LM head, the sampler). Measured on a 2-core Xeon with AMX (SmolLM2-135M bf16), 8 rows
decoding over one 1,500-token prefix took 39 ms a step, over 8 distinct 1,500-token prompts 60-68 ms, one
row 23 ms: a shared token cost ~40% of a distinct one (the quiet calibration of the same afternoon: 0.67 against
2.50 us a token, 27%). A fit without shared rows (`shared_context_s` None,
as every fit stored before it existed) prices H as C.

Where a model comes from:
- `agentrt simulate --calibrate` times the real engine on this machine (`agentrt/bench/calibrate.py`), fits the
  coefficients and stores the fit under `$AGENTRT_CACHE_DIR/calibration/`, keyed by model, dtype and CPU
  kind (instruction set, core count, torch threads). `for_this_machine()` finds it again; without one it
  warns and falls back to `DEFAULT_CPU` (a 2-core AVX2 CPU, fp32, fitted by hand in an earlier session).
- Named GPU models (`NAMED`), for full-size simulation, with their figures and sources.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

FEATURES = ("base", "tokens", "decode_rows", "context", "prefill_attn", "sampled_rows", "shared_context")


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds per step as a linear model over `FEATURES` (see the module doc)."""

    base_s: float = 0.050
    token_s: float = 0.0025
    decode_row_s: float = 0.0035
    context_s: float = 5e-6
    prefill_attn_s: float = 0.0
    sample_s: float = 0.0
    shared_context_s: float | None = None  # None: as context_s (a fit made without rows sharing blocks)

    def __call__(self, out: Any, block_size: int = 16) -> float:
        """Seconds for a scheduler output (an `engine.scheduler.SchedulerOutput`), before it is applied, on an
        engine of `block_size`-token KV blocks."""
        if not out.reqs:
            return 0.0
        return sum(c * x for c, x in zip(self.coefficients(), step_features(out, block_size)))

    def row_cost(self, n: int, done: int, total: int) -> float:
        """Seconds one row adds to its step (`row_features`; the step's base not included)."""
        return sum(c * x for c, x in zip(self.coefficients(), row_features(n, done, total)))

    def coefficients(self) -> tuple[float, ...]:
        """In `FEATURES` order."""
        values = tuple(getattr(self, f.name) for f in fields(self))
        return values[:-1] + (self.context_s if self.shared_context_s is None else self.shared_context_s,)

    @classmethod
    def parse(cls, text: str) -> StepCost:
        """"BASE,TOKEN,DECODE_ROW,CONTEXT[,PREFILL_ATTN[,SAMPLE[,SHARED_CONTEXT]]]" in seconds, each >= 0."""
        try:
            values = [float(x) for x in text.split(",")]
            if not 4 <= len(values) <= len(FEATURES) or min(values) < 0:
                raise ValueError
        except ValueError:
            raise SystemExit("--cost must be 4 to 7 numbers >= 0, "
                             "BASE,TOKEN,DECODE_ROW,CONTEXT[,PREFILL_ATTN[,SAMPLE[,SHARED_CONTEXT]]] "
                             f"(seconds), got {text!r}") from None
        return cls(*values)


def row_features(n: int, done: int, total: int) -> tuple[int, ...]:
    """One row's share of a step's `FEATURES` (its base is 0) as if it read its context alone: `n` tokens computed
    after `done`, of a request `total` tokens long (sampled once the step reaches its end)."""
    return (0, n, int(n == 1), done + n, n * done + n * (n + 1) // 2 if n > 1 else 0, int(done + n >= total), 0)


def step_features(out: Any, block_size: int = 16) -> tuple[int, ...]:
    """The model's inputs for one scheduled step, read before the step is applied (`FEATURES` order): the base
    and the sum of its rows' `row_features`, a row's context tokens in a KV block an earlier row of the step
    reads too counted as shared context (the rows' `block_ids`, blocks of `block_size` tokens)."""
    tokens = decode = context = attn = sampled = shared = 0
    seen: set[int] = set()
    for r, n in zip(out.reqs, out.num_tokens):
        _, t, d, c, a, s, _ = row_features(n, r.num_computed_tokens, r.num_tokens)
        h = 0
        for i, b in enumerate(getattr(r, "block_ids", ())[: -(-c // block_size)]):
            if b in seen:
                h += min(block_size, c - i * block_size)
            elif b >= 0:  # -1: a block a window layer group let go
                seen.add(b)
        tokens, decode, context, attn, sampled = tokens + t, decode + d, context + c - h, attn + a, sampled + s
        shared += h
    return (1, tokens, decode, context, attn, sampled, shared)


# A 2-core AVX2 CPU, SmolLM2-135M fp32, `agentrt bench programs`'s engine settings (decode 1 / 4 / 16 rows:
# ~56 / 77 / 148 ms; a 256-token prefill chunk: ~0.6-0.7 s). Used when this machine has no fit.
DEFAULT_CPU = StepCost()

# Llama-3.1-8B, bf16, on one H100 SXM (80 GB), from the spec sheets, not measured here: weights 16.1 GB read
# once a step at 3.35 TB/s HBM (4.8 ms) + ~2 ms launch/sampling overhead; 2 x 8.03 GFLOP per token at
# ~50% of 989 dense bf16 TFLOP/s (32.5 us/token); KV 128 KiB/token (32 layers x 8 KV heads x 128 x K,V x
# 2 B) read per step per context token (39 ns); prefill attention 4 x 32 x 4096 FLOP per (query, key)
# pair at the same rate (1.06 ns). KV memory: 80 GB - 16 GB weights - ~4 GB activations = ~60 GB =
# ~458k tokens.
H100_LLAMA8B = StepCost(base_s=0.0068, token_s=3.25e-5, decode_row_s=0.0, context_s=3.9e-8, prefill_attn_s=1.06e-9)
H100_KV_TOKENS = 458_000

# Llama-3.1-70B, bf16, tensor-parallel over 8 H100 SXM: weights 141 GB / 8 = 17.6 GB per GPU read once a step
# at 3.35 TB/s (5.3 ms) + ~4 ms launch / all-reduce overhead (80 layers x 2 all-reduces at ~25 us, NVLink
# 900 GB/s); 2 x 70.6 GFLOP per token over 8 GPUs at ~45% of 989 TFLOP/s (39.6 us/token); KV 320 KiB/token
# (80 layers x 8 KV heads x 128 x K,V x 2 B) read over 8 GPUs' HBM (12 ns); prefill attention 4 x 80 x 8192
# FLOP per pair over 8 GPUs (0.74 ns). KV memory: 8 x (80 - 17.6 - ~6) GB = ~450 GB = ~1.4M tokens.
H100X8_LLAMA70B = StepCost(base_s=0.0093, token_s=3.96e-5, decode_row_s=0.0, context_s=1.2e-8, prefill_attn_s=7.4e-10)
H100X8_KV_TOKENS = 1_400_000

# name -> (model, KV-cache tokens, where the figures come from)
NAMED: dict[str, tuple[StepCost, int | None, str]] = {
    "cpu-default": (DEFAULT_CPU, None, "SmolLM2-135M fp32 on a 2-core AVX2 CPU, fitted by hand (fallback)"),
    "h100-llama-3.1-8b": (H100_LLAMA8B, H100_KV_TOKENS, "Llama-3.1-8B bf16 on one H100 SXM, from NVIDIA's H100 "
                          "spec sheet (3.35 TB/s, 989 TFLOP/s dense bf16) and the model's config; not measured"),
    "h100x8-llama-3.1-70b": (H100X8_LLAMA70B, H100X8_KV_TOKENS, "Llama-3.1-70B bf16 over 8 H100 SXM (TP 8), "
                             "same spec sheet, NVLink 900 GB/s; not measured"),
}


def named(name: str) -> tuple[StepCost, int | None, str]:
    if name not in NAMED:
        raise SystemExit(f"unknown cost model {name!r}; known: {', '.join(NAMED)}")
    return NAMED[name]


# ---- fits stored per machine ---------------------------------------------------------------------------
def machine_kind() -> str:
    """This CPU as calibration sees it: the kernels' instruction set, cores and torch threads."""
    import torch

    from agentrt.kernels import cpu

    return f"{cpu.kind()}-{os.cpu_count()}c-{torch.get_num_threads()}t"


def fit_key(model: str, dtype: str, kind: str | None = None) -> str:
    return f"{model}--{dtype}--{kind or machine_kind()}"


def fits_dir() -> Path:
    """$AGENTRT_CALIBRATION_DIR, else `calibration/` in the engine's cache directory."""
    from agentrt.engine.loader import cache_dir

    return Path(os.environ.get("AGENTRT_CALIBRATION_DIR") or cache_dir() / "calibration")


@dataclass(frozen=True, slots=True)
class Fit:
    key: str
    cost: StepCost
    created: str  # UTC date
    error: dict[str, float]  # how well the fit reproduces the timings it came from
    steps: int  # timed steps it was fitted on
    cpu: str = ""  # the CPU's model name and flags that matter

    def describe(self) -> str:
        return (f"calibrated fit {self.key} ({self.created}, {self.steps} steps, median step error "
                f"{self.error.get('median_rel', float('nan')):.1%})")


def store(fit: Fit, directory: Path | None = None) -> Path:
    path = (directory or fits_dir()) / f"{fit.key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**asdict(fit), "cost": asdict(fit.cost)}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
    return path


def load(key: str, directory: Path | None = None) -> Fit | None:
    path = (directory or fits_dir()) / f"{key}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return Fit(**{**data, "cost": StepCost(**data["cost"])})


def default_model_and_dtype(model: str | None = None, dtype: str | None = None) -> tuple[str, str]:
    """The names a fit is keyed by for an engine built with these arguments (no weights loaded)."""
    from agentrt.engine import loader
    from agentrt.engine.config import auto_dtype

    if model is None:
        name = loader.converted_path(loader.default_gguf_path(), loader.DEFAULT_MODEL_NAME).name
    else:
        path = Path(model).expanduser()
        name = loader.converted_path(path, path.stem).name if path.suffix == ".gguf" else path.name
    if dtype in (None, "auto"):
        dtype = os.environ.get("AGENTRT_DTYPE") or "auto"
    if dtype == "auto":
        dtype = auto_dtype("cpu")[0]
    return name, dtype


def for_this_machine(model: str | None = None, dtype: str | None = None, *, quiet: bool = False,
                     directory: Path | None = None) -> tuple[StepCost, str]:
    """The stored fit for this machine, model and dtype, and a line saying which; without one, a warning and
    `DEFAULT_CPU`."""
    key = fit_key(*default_model_and_dtype(model, dtype))
    fit = load(key, directory)
    if fit is not None:
        return fit.cost, f"step costs: {fit.describe()}"
    msg = (f"no calibrated step-cost fit for this machine ({key}): using the built-in 2-core AVX2 fp32 model; "
           "run `agentrt simulate --calibrate` for one")
    if not quiet:
        print(f"agentrt: warning: {msg}", file=sys.stderr)
    return DEFAULT_CPU, f"step costs: warning: {msg}"


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
