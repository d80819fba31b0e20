"""The batched sampler (its parameters and their validation: engine/sampling_params.py).

`sample` is a module-level hot-path function: one call per step for the whole batch, no Python
loop over requests except to build the per-row parameter tensors (done once per step), and none
over the vocabulary. The processors follow vLLM's semantics and order:

    raw logits -> log-probs returned (logprobs / top_logprobs: from the raw logits)
      -> min_tokens (EOS and stop_token_ids masked while the output is shorter)
      -> logit_bias (added)
      -> repetition_penalty (prompt and output tokens: logit / p if > 0 else logit * p)
      -> frequency_penalty (- f * count in the output), presence_penalty (- p if in the output)
      -> greedy: argmax | random: temperature -> min_p -> top_k -> top_p -> draw
         (on the top CANDIDATES tokens when the kept set lies within them: `sample_random`)

Penalties touch only the (row, token) pairs a request has seen (`torch.unique` over its history,
kept per request as a tensor grown in place: `TokenHistory`), never a [B, V] count tensor.
Requests that use penalties or min_tokens carry no speculative drafts (engine.spec_decode): each
draft row would need the history up to that draft.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams

CANDIDATES = 256  # random rows whose kept tokens lie among their top this many are drawn among them


class TokenHistory:
    """A request's prompt then output token ids as a CPU int64 tensor, grown in place as tokens are
    appended (capacity doubles), so a step's penalties never convert a whole Python list."""

    __slots__ = ("buf", "size")

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.long)
        self.size = 0

    def update(self, token_ids: list[int]) -> torch.Tensor:
        """The tensor of `token_ids`, which extends the ids of the last call (all_token_ids only grows)."""
        n = len(token_ids)
        if n > self.buf.numel():
            buf = torch.empty(max(n, 2 * self.buf.numel(), 64), dtype=torch.long)
            buf[: self.size] = self.buf[: self.size]
            self.buf = buf
        if n > self.size:
            self.buf[self.size : n] = torch.tensor(token_ids[self.size : n], dtype=torch.long)
            self.size = n
        return self.buf[:n]


@dataclass(slots=True)
class RowContext:
    """What the history-dependent processors (penalties, min_tokens) read about one row's request."""

    token_ids: torch.Tensor  # [L] int64 (CPU): the prompt, then the output so far
    num_prompt_tokens: int
    stop_token_ids: list[int]  # masked while the output is shorter than min_tokens (EOS unless
    # ignore_eos, and stop_token_ids)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64: the sampled token of each row
    logprobs: torch.Tensor | None  # [B] fp32: its log-prob under the raw logits; None when no row wants it
    top_token_ids: torch.Tensor | None  # [B, N] int64: the N most likely tokens, best first
    # (N = the batch's largest top_logprobs); None when N = 0
    top_logprobs: torch.Tensor | None  # [B, N] fp32: their log-probs


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    contexts: list[RowContext | None] | None = None,
) -> SamplerOutput:
    """Sample one token per row (order of the processors: module docstring); log-probs (of the
    sampled and of the top-N tokens) come from the raw logits' log_softmax, before any processor.

    logits: [B, V] (any float dtype; computed in fp32). contexts: per row, needed for the rows whose
    params use penalties or min_tokens (None elsewhere).
    """
    with _one_thread(logits.device):
        return _sample(logits, params, generators, contexts)


@contextlib.contextmanager
def _one_thread(device: torch.device):
    """The sampler on one intra-op CPU thread: its ops are small ([B, V] at most, mostly [B, CANDIDATES]),
    and waking a second thread costs more than it saves (measured on the shared 2-core machine:
    logsumexp over [32, 256] 4 ms with 2 threads, 0.06 ms with 1; argmax over [32, 49152] 16 vs 3 ms)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _sample(logits, params, generators, contexts) -> SamplerOutput:
    raw = logits.float()
    vocab = raw.shape[1]
    num_top = min(max(p.top_logprobs for p in params), vocab)
    logp = raw.log_softmax(dim=-1) if num_top > 0 or any(p.logprobs for p in params) else None
    # a private fp32 copy (the input was not fp32) is processed in place: the raw log-probs are taken
    logits = process_logits(raw, params, contexts, inplace=raw is not logits)
    greedy = [p.greedy for p in params]
    if all(greedy):
        tokens = logits.argmax(dim=-1)
    else:
        rows = [i for i, g in enumerate(greedy) if not g]
        tokens = logits.argmax(dim=-1) if any(greedy) else torch.empty(len(params), dtype=torch.long, device=logits.device)
        sub = logits if len(rows) == len(params) else logits[rows]
        tokens[rows] = sample_random(sub, [params[i] for i in rows], [generators[i] for i in rows])
    out = SamplerOutput(tokens, None, None, None)
    if logp is not None:
        out.logprobs = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        if num_top > 0:
            out.top_logprobs, out.top_token_ids = logp.topk(num_top, dim=-1)
    return out


def sample_random(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of non-greedy rows: temperature, min_p, top_k, top_p, then the draw.

    A row whose kept tokens all lie among its top CANDIDATES (top_k <= CANDIDATES, or a top_p / min_p
    set that ends within them: the usual case) is warped and drawn on those candidates alone, from one
    `topk` instead of full-vocabulary sorts; the others go through `warp` over the whole row. Both
    draw from the same distribution, and which one a row takes depends on its own logits only, so a
    seeded request draws the same tokens whatever it is batched with.

    logits: [R, V] fp32 after process_logits. Returns [R] int64.
    """
    dev, vocab = logits.device, logits.shape[1]
    c = min(CANDIDATES, vocab)
    temps = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
    k_t = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
    vals, idx = logits.topk(c, dim=-1)  # [R, c], best first (temperature > 0 keeps the order)
    vals = vals / temps
    vals = vals.masked_fill(torch.arange(c, device=dev) >= k_t.unsqueeze(1), float("-inf"))
    log_min_p = None
    if any(p.min_p > 0.0 for p in params):
        log_min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=dev)
        vals = vals.masked_fill(vals < vals[:, :1] + log_min_p.unsqueeze(1), float("-inf"))
    within_k = k_t <= c
    norm = vals.logsumexp(dim=-1, keepdim=True)  # the kept set's mass where it lies within the candidates
    if not bool(within_k.all()):
        full = logits / temps
        if log_min_p is not None:
            full = full.masked_fill(full < vals[:, :1] + log_min_p.unsqueeze(1), float("-inf"))
        norm = torch.where(within_k.unsqueeze(1), norm, full.logsumexp(dim=-1, keepdim=True))
    probs = (vals - norm).exp()  # [R, c]: the candidates' probabilities under the row's whole distribution
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in params], device=dev)
    before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(before >= top_p.unsqueeze(1), 0.0)
    mass = before[:, -1] + probs[:, -1]
    fits = within_k | torch.isinf(vals[:, -1]) | (mass >= top_p)  # no kept token past the candidates
    fits_list = fits.tolist()
    tokens = torch.empty(len(params), dtype=torch.long, device=dev)
    near = [i for i, f in enumerate(fits_list) if f]
    far = [i for i, f in enumerate(fits_list) if not f]
    if near:
        pick = _race(probs[near], [generators[i] for i in near])
        tokens[near] = idx[near].gather(1, pick.unsqueeze(1)).squeeze(1)
    if far:
        whole = warp(logits[far], [params[i] for i in far]).softmax(dim=-1)
        tokens[far] = _race(whole, [generators[i] for i in far])
    return tokens


def _race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E) with E ~ Exp(1), one draw per row. Per-row generators
    keep seeds reproducible (a seeded request's generator lives on the CPU: its row is drawn there, so a
    seed gives the same tokens on any device). probs: [R, N]."""
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.exponential_()
    for i, g in enumerate(generators):
        if g is None:
            continue
        if g.device == noise.device:
            noise[i].exponential_(generator=g)
        else:
            noise[i].copy_(torch.empty(noise.shape[1], dtype=noise.dtype, device=g.device).exponential_(generator=g))
    return (probs / noise).argmax(dim=-1)


def warp(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then min_p, top_k, top_p as -inf: the logits the random draw softmaxes. [B, V] fp32."""
    dev, vocab = logits.device, logits.shape[1]
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
    scaled = logits / temps.unsqueeze(1)
    if any(p.min_p > 0.0 for p in params):
        # p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p): no softmax needed
        log_min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=dev)
        floor = scaled.amax(dim=-1) + log_min_p
        scaled = scaled.masked_fill(scaled < floor.unsqueeze(1), float("-inf"))
    top_ks = [p.top_k for p in params]
    if any(0 < k < vocab for k in top_ks):
        k_t = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_ks], device=dev)
        sorted_vals = scaled.sort(dim=-1, descending=True).values
        kth = sorted_vals.gather(1, (k_t - 1).unsqueeze(1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    top_ps = [p.top_p for p in params]
    if any(p < 1.0 for p in top_ps):
        # rows at 1.0 drop nothing (a float cumsum can reach 1.0 before the tail: batched rows stay as alone)
        p_t = torch.tensor([p if p < 1.0 else math.inf for p in top_ps], device=dev).unsqueeze(1)
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p_t
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def process_logits(
    logits: torch.Tensor, params: list[SamplingParams], contexts: list[RowContext | None] | None,
    inplace: bool = False,
) -> torch.Tensor:
    """The logits after min_tokens, logit_bias and the penalties (a new tensor when any applies,
    unless `inplace`; `logits` itself when none does). logits: [B, V] fp32."""
    minimum = [i for i, p in enumerate(params) if p.min_tokens > 0]
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    penalized = [i for i, p in enumerate(params) if p.uses_penalties]
    if not (minimum or biased or penalized):
        return logits
    if not inplace:
        logits = logits.clone()
    dev, vocab = logits.device, logits.shape[1]
    if minimum or biased:
        rows, toks, vals = [], [], []
        for i in minimum:
            ctx = contexts[i]
            if ctx.token_ids.numel() - ctx.num_prompt_tokens < params[i].min_tokens:
                stops = [t for t in ctx.stop_token_ids if t < vocab]
                rows += [i] * len(stops)
                toks += stops
                vals += [-math.inf] * len(stops)
        for i in biased:
            bias = params[i].logit_bias
            rows += [i] * len(bias)
            toks += bias.keys()
            vals += bias.values()
        if rows:
            index = (torch.tensor(rows, device=dev), torch.tensor(toks, device=dev))
            logits.index_put_(index, torch.tensor(vals, device=dev), accumulate=True)
    if penalized:
        apply_penalties(logits, [params[i] for i in penalized], [contexts[i] for i in penalized], penalized)
    return logits


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], contexts: list[RowContext], rows: list[int]
) -> None:
    """Repetition, frequency and presence penalties, in place, on `rows` of logits [B, V] (fp32).
    Only the distinct (row, token) pairs of the rows' histories are read and written."""
    dev, vocab = logits.device, logits.shape[1]
    lengths = torch.tensor([c.token_ids.numel() for c in contexts])
    tokens = torch.cat([c.token_ids for c in contexts]).clamp_(0, vocab - 1)  # [T]
    row_of = torch.repeat_interleave(torch.tensor(rows), lengths)  # [T]
    starts = torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    num_prompt = torch.repeat_interleave(torch.tensor([c.num_prompt_tokens for c in contexts]), lengths)
    is_output = torch.arange(tokens.numel()) - starts >= num_prompt  # [T]
    keys = row_of * vocab + tokens
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = torch.unique(keys).to(dev)
        r, t = seen // vocab, seen % vocab
        penalty = torch.ones(logits.shape[0], device=dev)
        penalty[torch.tensor(rows, device=dev)] = torch.tensor([p.repetition_penalty for p in params], device=dev)
        vals, pen = logits[r, t], penalty[r]
        logits[r, t] = torch.where(vals > 0, vals / pen, vals * pen)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        out_keys, counts = torch.unique(keys[is_output], return_counts=True)
        if out_keys.numel():
            out_keys, counts = out_keys.to(dev), counts.to(dev)
            r, t = out_keys // vocab, out_keys % vocab
            freq = torch.zeros(logits.shape[0], device=dev)
            pres = torch.zeros(logits.shape[0], device=dev)
            index = torch.tensor(rows, device=dev)
            freq[index] = torch.tensor([p.frequency_penalty for p in params], device=dev)
            pres[index] = torch.tensor([p.presence_penalty for p in params], device=dev)
            logits[r, t] -= freq[r] * counts + pres[r]
