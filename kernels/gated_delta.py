"""The gated delta rule of Gated DeltaNet (Qwen3.5's linear-attention layers), in torch: a chunked scan for
prefill (`chunk_gated_delta_rule`), one recurrent step for decode (`gated_delta_step`), and the token-by-token
recurrence both are tested against (`gated_delta_rule_ref`). fp32 throughout; the state is fp32.

Per value head, with q, k L2-normalized (q also scaled by Dk^-0.5), decay g <= 0 (log space) and rate beta:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T      S: [Dk, Dv]
    o_t = S_t^T q_t

The chunked form (the DeltaNet paper's UT transform, as transformers' `torch_chunk_gated_delta_rule`) solves
the C steps of a chunk with two triangular solves and a few matmuls, then carries S chunk to chunk. Chunks here
are aligned to absolute positions (`start`: the first token's position; the first chunk is padded at the front
with steps that leave the state as it is: k = v = 0, beta = 0, g = 0), so every multiple of C is a chunk end
and the state there can be kept (`keep`): a paged engine snapshots the state at block boundaries this way.
Memory traffic of a chunk: q, k, v once, the state twice; work O(C (Dk + Dv) Dk) per token.
Limits: one sequence per call (the caller loops over a batch's prefill rows); no Triton kernel yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's and transformers' convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, start: int = 0, chunk: int = 64, keep: tuple[int, ...] = ()
                           ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One sequence's T steps from `state`.

    q, k: [T, H, Dk] fp32, normalized and q scaled; v: [T, H, Dv]; g, beta: [T, H]; state: [H, Dk, Dv] fp32
    (not modified). `start`: the absolute position of the first step (chunks end at multiples of `chunk`);
    `keep`: step counts o (1 <= o <= T, start + o a multiple of `chunk`) after which to return the state.
    Returns (out [T, H, Dv], the final state [H, Dk, Dv], the kept states in `keep`'s order)."""
    T, H, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk
    front = start % C
    for o in keep:
        if not 1 <= o <= T or (start + o) % C:
            raise ValueError(f"cannot keep the state after {o} of {T} steps from position {start}: not a "
                             f"chunk end (chunk {C})")
    back = (-(front + T)) % C
    n = (front + T + back) // C

    def prep(x):  # [T, H, ...] -> [H, n, C, ...], zero-padded
        x = x.transpose(0, 1)
        pad = [0, 0] * (x.dim() - 2) + [front, back]
        return F.pad(x, pad).reshape(H, n, C, *x.shape[2:])

    q, k, v = prep(q), prep(k), prep(v)
    g, beta = prep(g), prep(beta)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)  # [H, n, C]
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [H, n, C, C]
    k_beta = k * beta.unsqueeze(-1)
    # strictly lower part: the UT system I + A (A_ij = beta_i k_i.k_j decay_ij, i > j)
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(C, dtype=q.dtype, device=q.device)
    new_v = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay  # [H, n, C, C], zero above the diagonal
    q_dec = q * cum.exp().unsqueeze(-1)
    k_dec = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    out = torch.empty(H, n, C, Dv, dtype=q.dtype, device=q.device)
    want = {(front + o) // C - 1: i for i, o in enumerate(keep)}
    kept: list[torch.Tensor | None] = [None] * len(keep)
    s = state.to(q.dtype)
    for i in range(n):
        v_i = new_v[:, i] - k_cum[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + intra[:, i] @ v_i
        s = s * chunk_decay[:, i] + k_dec[:, i].transpose(-1, -2) @ v_i
        if i in want:
            kept[want[i]] = s
    out = out.reshape(H, n * C, Dv)[:, front : front + T].transpose(0, 1)
    return out, s, kept


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor:
    """One step of B sequences, the state updated in place. q, k: [B, H, Dk] fp32 (normalized, q scaled); v:
    [B, H, Dv]; g, beta: [B, H]; state: [B, H, Dk, Dv] fp32. Returns out [B, H, Dv]."""
    state.mul_(g.exp()[..., None, None])
    kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)  # [B, H, Dv]
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return (state * q.unsqueeze(-1)).sum(dim=-2)


def gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token (the reference): q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H], state
    [H, Dk, Dv] (not modified). Returns (out [T, H, Dv], final state)."""
    s = state.clone().unsqueeze(0)
    outs = [gated_delta_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)
            for t in range(q.shape[0])]
    return torch.cat(outs), s[0]
