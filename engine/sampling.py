"""Sampling parameters and the batched sampler.

`sample` is a module-level hot-path function: one call per step for the whole batch, no Python
loop over requests except to build the per-row parameter tensors (done once per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingParams:
    """How one request is decoded. Validated on construction; bad values raise ValueError."""

    max_tokens: int = 16  # tokens to generate at most
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 = off
    top_p: float = 1.0  # nucleus mass in (0, 1]
    seed: int | None = None  # per-request generator seed: same seed, same tokens
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the output
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end the request
    ignore_eos: bool = False  # keep going past EOS (benchmarks)
    logprobs: bool = False  # return the log-probability of each sampled token
    n: int = 1  # completions per prompt (forks sharing the prompt's KV)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    want_logprobs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample one token per row.

    logits: [B, V] (any float dtype; computed in fp32). Returns (token ids [B] int64,
    logprobs of the chosen tokens [B] or None).
    """
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        tokens = greedy_tokens
    else:
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
        scaled = logits / temps.unsqueeze(1)
        top_ks = [p.top_k for p in params]
        if any(k > 0 for k in top_ks):
            vocab = scaled.shape[1]
            k_t = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device).clamp(max=vocab)
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
    logprobs = None
    if want_logprobs:
        logprobs = logits.log_softmax(dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, logprobs
