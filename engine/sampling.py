"""Sampling parameters, the errors for input the engine refuses, and the batched sampler.

`sample` is a module-level hot-path function: one call per step for the whole batch, no Python
loop over requests except to build the per-row parameter tensors (done once per step).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import torch

MAX_TOP_LOGPROBS = 20  # most alternatives per token `top_logprobs` may ask for
MAX_N = 128  # most completions per prompt: each is a request of its own in the batch
MAX_SEED = 2**63 - 1
GREEDY_BELOW = 1e-5  # temperatures under this decode greedily (dividing by them overflows fp32)


class InvalidRequestError(ValueError):
    """The engine refuses a request: a bad sampling parameter, prompt or id. The message names the
    field and the offending value. Raised before anything is queued."""


class InvalidRequestTypeError(InvalidRequestError, TypeError):
    """A request field of the wrong type. Also a ValueError, so one `except ValueError` catches every
    refused request."""


@dataclass(slots=True)
class SamplingParams:
    """How one request is decoded. Every field is checked on construction (and again when the request
    is added); a bad one raises `InvalidRequestError` (a ValueError) or `InvalidRequestTypeError`
    (also a TypeError) naming the field and the value."""

    max_tokens: int = 16  # tokens to generate at most, >= 1
    temperature: float = 1.0  # finite, >= 0; 0 (or under GREEDY_BELOW) = greedy
    top_k: int = -1  # -1 = off, else >= 1
    top_p: float = 1.0  # nucleus mass in (0, 1]
    seed: int | None = None  # per-request generator seed in [0, 2**63 - 1]: same seed, same tokens
    stop: list[str] = field(default_factory=list)  # stop strings (a str is one), not included in the output
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end the request (< vocab, checked at add)
    ignore_eos: bool = False  # keep going past EOS (benchmarks)
    logprobs: bool = False  # return the log-probability of each sampled token
    top_logprobs: int = 0  # 0..MAX_TOP_LOGPROBS: also return the N most likely tokens at each position
    # (with their log-probs, best first), and the sampled tokens' log-probs
    n: int = 1  # completions per prompt (forks sharing the prompt's KV), 1..MAX_N
    constraint: Any = None  # engine.structured.Constraint: the output must match this grammar (None = free)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check (and normalize) every field; raises InvalidRequestError / InvalidRequestTypeError."""
        self.max_tokens = _int("max_tokens", self.max_tokens, 1)
        self.temperature = _real("temperature", self.temperature, 0.0)
        self.top_k = _int("top_k", self.top_k, -1, what="-1 (off) or an int >= 1")
        if self.top_k == 0:
            raise InvalidRequestError("SamplingParams.top_k must be -1 (off) or an int >= 1, got 0")
        self.top_p = _real("top_p", self.top_p, 0.0, 1.0, what="a number in (0, 1]")
        if self.top_p == 0.0:
            raise InvalidRequestError("SamplingParams.top_p must be a number in (0, 1], got 0.0")
        if self.seed is not None:
            self.seed = _int("seed", self.seed, 0, MAX_SEED, what="an int in [0, 2**63 - 1] or None")
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _token_ids(self.stop_token_ids)
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        self.logprobs = _bool("logprobs", self.logprobs)
        self.top_logprobs = _int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        self.n = _int("n", self.n, 1, MAX_N)
        if self.constraint is not None:
            from engine.structured import Constraint

            if not isinstance(self.constraint, Constraint):
                raise InvalidRequestTypeError(
                    f"SamplingParams.constraint must be an engine.structured.Constraint or None, got {show_value(self.constraint)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def wants_logprobs(self) -> bool:
        """Whether the sampled tokens' log-probs are returned."""
        return self.logprobs or self.top_logprobs > 0


def show_value(value: Any, with_type: bool = True) -> str:
    """A bad value for an error message: its repr (cut at 80 characters) and its type."""
    try:
        text = repr(value)
    except Exception:  # an int past Python's 4300-digit str limit, or a __repr__ that fails
        text = "<unprintable>"
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})" if with_type else text


def _int(name: str, value: Any, lo: int, hi: int | None = None, what: str | None = None) -> int:
    if what is None:
        what = f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequestTypeError(f"SamplingParams.{name} must be {what}, got {show_value(value)}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        raise InvalidRequestError(f"SamplingParams.{name} must be {what}, got {show_value(value, False)}")
    return value


def _real(name: str, value: Any, lo: float, hi: float | None = None, what: str | None = None) -> float:
    if what is None:
        what = f"a finite number in [{lo}, {hi}]" if hi is not None else f"a finite number >= {lo}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequestTypeError(f"SamplingParams.{name} must be {what}, got {show_value(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int past the float range
        number = math.inf
    if not math.isfinite(number) or number < lo or (hi is not None and number > hi):
        raise InvalidRequestError(f"SamplingParams.{name} must be {what}, got {show_value(value, False)}")
    return number


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestTypeError(f"SamplingParams.{name} must be a bool, got {show_value(value)}")
    return value


def _stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise InvalidRequestTypeError(f"SamplingParams.stop must be a str or a list of str, got {show_value(stop)}")
    for s in stop:
        if not isinstance(s, str):
            raise InvalidRequestTypeError(f"SamplingParams.stop must be a str or a list of str, got item {show_value(s)}")
        if not s:
            raise InvalidRequestError(f"SamplingParams.stop must be non-empty strings, got {show_value(list(stop), False)}")
        if not _encodable(s):
            raise InvalidRequestError(f"SamplingParams.stop must be valid Unicode, got {s!r} (a lone surrogate)")
    return list(stop)


def _token_ids(ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise InvalidRequestTypeError(f"SamplingParams.stop_token_ids must be a list of int, got {show_value(ids)}")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise InvalidRequestTypeError(f"SamplingParams.stop_token_ids must be a list of int, got item {show_value(t)}")
        if t < 0:
            raise InvalidRequestError(f"SamplingParams.stop_token_ids must be token ids >= 0, got {show_value(t, False)}")
    return [int(t) for t in ids]


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64: the sampled token of each row
    logprobs: torch.Tensor | None  # [B] fp32: its log-prob under the raw logits; None when no row wants it
    top_token_ids: torch.Tensor | None  # [B, N] int64: the N most likely tokens, best first
    # (N = the batch's largest top_logprobs); None when N = 0
    top_logprobs: torch.Tensor | None  # [B, N] fp32: their log-probs


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> SamplerOutput:
    """Sample one token per row; log-probs (of the sampled and of the top-N tokens) come from the raw
    logits' log_softmax, before temperature, top-k and top-p.

    logits: [B, V] (any float dtype; computed in fp32).
    """
    logits = logits.float()
    vocab = logits.shape[1]
    greedy_tokens = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        tokens = greedy_tokens
    else:
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
        scaled = logits / temps.unsqueeze(1)
        top_ks = [p.top_k for p in params]
        if any(0 < k < vocab for k in top_ks):
            k_t = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_ks], device=logits.device)
            sorted_vals = scaled.sort(dim=-1, descending=True).values
            kth = sorted_vals.gather(1, (k_t - 1).unsqueeze(1))
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        top_ps = [p.top_p for p in params]
        if any(p < 1.0 for p in top_ps):
            p_t = torch.tensor(top_ps, device=logits.device).unsqueeze(1)
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            # drop a token when the mass before it already reaches top_p (the top token always stays)
            drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= p_t
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            scaled = scaled.masked_fill(drop, float("-inf"))
        probs = scaled.softmax(dim=-1)
        # exponential-race sampling: argmax(p / E) with E ~ Exp(1); per-row generators keep seeds reproducible
        # (a seeded request's generator lives on the CPU: its row is drawn there, so a seed gives the same
        # tokens on any device)
        noise = torch.empty_like(probs)
        for i, g in enumerate(generators):
            if g is None or g.device == noise.device:
                noise[i].exponential_(generator=g)
            else:
                noise[i].copy_(torch.empty(noise.shape[1], dtype=noise.dtype, device=g.device).exponential_(generator=g))
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        tokens = torch.where(is_greedy, greedy_tokens, sampled)
    out = SamplerOutput(tokens, None, None, None)
    num_top = min(max(p.top_logprobs for p in params), vocab)
    if num_top > 0 or any(p.logprobs for p in params):
        logp = logits.log_softmax(dim=-1)
        out.logprobs = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        if num_top > 0:
            out.top_logprobs, out.top_token_ids = logp.topk(num_top, dim=-1)
    return out
