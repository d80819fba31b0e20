"""N-gram speculative decoding (prompt lookup), exact for greedy requests.

Before a step, each eligible running request proposes up to k draft tokens: the tokens that
followed the most recent earlier occurrence of its last n tokens (n from `prompt_lookup_max` down
to `prompt_lookup_min`) in its own prompt and output. The step computes the request's last token
and its drafts together (one more query row per draft, like a short prefill chunk) and samples a
token at every row; the drafts that equal the greedy token at the row before them are accepted,
plus the token after the last accepted one. So the output is token-for-token the same as
decoding one token per step, and a step yields 1 to k+1 tokens.

Why it pays on CPU: a decode step reads every weight once whatever the number of rows (measured
on 2 cores: the 121 projections of SmolLM2-135M take ~the same time for 1 to 4 rows), so accepted
drafts are almost free. Agent contexts repeat themselves (tool outputs quoted back, code edits,
loops of a small model), which is where prompt lookup finds drafts. Rejected drafts cost their
share of the step; their KV slots are simply overwritten later.

Only greedy requests without logprobs, n > 1 forks, penalties or min_tokens speculate (a draft
row's penalties would need the history up to that draft); others decode as usual.
"""

from __future__ import annotations

import numpy as np

from agentrt.engine.request import Request


def propose_ngram(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix n-gram
    (max_n >= n >= min_n) of `tokens`; [] when there is none."""
    size = len(tokens)
    if k <= 0 or size <= min_n:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = arr[size - n :]
        match = arr[: size - n] == tail[0]  # windows arr[j : j + n] for j < size - n (not the tail itself)
        for i in range(1, n):
            match &= arr[i : size - n + i] == tail[i]
        hits = np.flatnonzero(match)
        if hits.size:
            j = int(hits[-1]) + n
            return arr[j : j + k].tolist()
    return []


def speculates(req: Request) -> bool:
    """Whether a request may carry drafts: greedy, no logprobs, no forks, no grammar, no penalties,
    min_tokens or bad_words, not pooling, in its decode phase."""
    p = req.sampling
    return (
        p.greedy
        and p.pooling is None
        and not req.constrained
        and not p.logprobs
        and not p.reads_history
        and p.n == 1
        and req.parent is None
        and not req.children
        and req.num_computed_tokens == req.num_tokens - 1
    )


def propose(req: Request, k: int, max_n: int, min_n: int) -> None:
    """Set `req.spec_token_ids` (possibly empty), never past max_tokens or the context limit."""
    room = min(k, req.sampling.max_tokens - req.num_output_tokens - 1, req.max_model_len - req.num_tokens - 1)
    req.spec_token_ids = propose_ngram(req.all_token_ids, room, max_n, min_n) if room > 0 and speculates(req) else []


def verify(drafts: list[int], sampled: list[int]) -> list[int]:
    """Tokens to emit: the drafts that match the sampled tokens, then the first sampled token that
    differs (or the bonus token after all drafts). `sampled` has one token per row: len(drafts) + 1."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == sampled[accepted]:
        accepted += 1
    return sampled[: accepted + 1]
