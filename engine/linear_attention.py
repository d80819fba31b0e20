"""Gated DeltaNet, the linear-attention layer of Qwen3.5's hybrid decoder (three of them per full-attention
layer, HF `layer_types` "linear_attention"), and what a config says about it (`LinearAttentionArgs`).

A step's rows [T, hidden] are projected to q, k, v (one stream of conv_dim channels), the output gate z, the
rate b and the decay input a; q, k, v pass a depthwise causal conv (kernel K, SiLU) that reads each sequence's
last K - 1 inputs from its conv state; q and k (one head per `num_v_heads / num_k_heads` value heads) are
L2-normalized, beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias); the gated delta rule
(kernels.gated_delta) runs from the sequence's recurrent state; its output is RMS-normed per head, times
SiLU(z), and projected back. States live in the engine's `RecurrentStatePool` (engine.recurrent_state), one
live slot per sequence, updated in place; the step (`RecurrentStep`) says which slot each sequence of the
flat batch uses and where to save snapshots at block boundaries.

Decode rows (one token of a sequence) are computed together, one recurrent step for all; prefill rows one
sequence at a time, the chunked scan aligned to absolute positions (snapshots at chunk ends). Numbers as
transformers' `Qwen3_5GatedDeltaNet` (fp32 state; q, k, v, g and beta in fp32 for the rule).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.kernels.gated_delta import chunk_gated_delta_rule, gated_delta_step, l2norm
from agentrt.kernels.linear import Linear, PackCache

LINEAR_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")


@dataclass(slots=True, frozen=True)
class LinearAttentionArgs:
    num_k_heads: int
    num_v_heads: int
    key_dim: int  # per head
    value_dim: int  # per head
    conv_kernel: int  # K

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.key_dim + self.num_v_heads * self.value_dim

    @classmethod
    def from_hf(cls, cfg) -> LinearAttentionArgs | None:
        if cfg.model_type not in LINEAR_MODEL_TYPES:
            return None
        if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({cfg.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({cfg.linear_num_key_heads})")
        return cls(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                   cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim)


class RecurrentSlot:
    """The recurrent-state step of the current forward, shared by a model's linear layers (as `LoRASlot` is
    for adapters): the runner sets it around a forward (`use`)."""

    def __init__(self):
        self.step = None  # engine.recurrent_state.RecurrentStep

    @contextmanager
    def use(self, step):
        self.step = step
        try:
            yield
        finally:
            self.step = None


class GatedDeltaNet(nn.Module):
    rope_key = "default"  # the decoder hands every token mixer a rotary table; this one reads none

    def __init__(self, hidden_size: int, la: LinearAttentionArgs, eps: float, state_index: int,
                 recurrent: RecurrentSlot | None = None):
        super().__init__()
        self.args, self.eps = la, eps
        self.state_index = state_index  # this layer's row in the state pool's tensors
        self.recurrent = recurrent or RecurrentSlot()
        self.key_size, self.value_size = la.num_k_heads * la.key_dim, la.num_v_heads * la.value_dim
        # q, k, v (conv_dim), z (value_size), b and a (num_v_heads each) in one projection
        self.in_proj = Linear(hidden_size, la.conv_dim + self.value_size + 2 * la.num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(la.conv_dim, la.conv_kernel))  # depthwise, no bias
        self.A_log = nn.Parameter(torch.empty(la.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(la.num_v_heads))
        self.norm_weight = nn.Parameter(torch.empty(la.value_dim))
        self.out_proj = Linear(self.value_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope=None, k_cache=None, v_cache=None, meta=None, slot_mapping=None
                ) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]. The attention arguments are unused: no KV, the state is in the step's pool
        step = self.recurrent.step
        if step is None:
            raise RuntimeError("a linear-attention layer ran without a recurrent-state step (RecurrentSlot.use)")
        la = self.args
        T = x.shape[0]
        proj = self.in_proj(x)
        mixed, z, b, a = proj.split([la.conv_dim, self.value_size, la.num_v_heads, la.num_v_heads], dim=-1)
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = torch.empty(T, la.num_v_heads, la.value_dim, dtype=torch.float32, device=x.device)
        qsl = step.query_start_loc
        decode, rows, slots = step.decode()
        if decode:
            out[rows] = self._decode(mixed[rows], g[rows], beta[rows], slots, step, decode)
        for i in range(len(step.slots)):
            s, e = qsl[i], qsl[i + 1]
            if e - s > 1:
                out[s:e] = self._prefill(mixed[s:e], g[s:e], beta[s:e], step, i)
        h = self._gated_norm(out, z.reshape(T, la.num_v_heads, la.value_dim))
        return self.out_proj(h.reshape(T, self.value_size).to(x.dtype))

    def streamed_weights(self) -> list[tuple[PackCache, torch.Tensor]]:
        return [(lin.pack_cache, lin.weight) for lin in (self.in_proj, self.out_proj)]

    def _qkv(self, conv_out: torch.Tensor):
        """Conv output [R, conv_dim] fp32 -> q, k [R, Hv, Dk] (normalized, q scaled), v [R, Hv, Dv]."""
        la = self.args
        R = conv_out.shape[0]
        q, k, v = conv_out.split([self.key_size, self.key_size, self.value_size], dim=-1)
        rep = la.num_v_heads // la.num_k_heads
        q = l2norm(q.reshape(R, la.num_k_heads, la.key_dim)).repeat_interleave(rep, dim=1) * la.key_dim**-0.5
        k = l2norm(k.reshape(R, la.num_k_heads, la.key_dim)).repeat_interleave(rep, dim=1)
        return q, k, v.reshape(R, la.num_v_heads, la.value_dim)

    def _decode(self, mixed, g, beta, slots, step, seqs) -> torch.Tensor:
        # one token per sequence: the conv's window is its state plus this input
        pool, li = step.pool, self.state_index
        conv_state = pool.conv[li].index_select(0, slots)  # [B, C, K - 1]
        window = torch.cat([conv_state, mixed.float().unsqueeze(-1)], dim=-1)  # [B, C, K]
        conv_out = F.silu((window * self.conv_weight.float()).sum(dim=-1))
        pool.conv[li].index_copy_(0, slots, window[..., 1:])
        q, k, v = self._qkv(conv_out)
        state = pool.ssm[li].index_select(0, slots)
        o = gated_delta_step(q, k, v, g, beta, state)
        pool.ssm[li].index_copy_(0, slots, state)
        for j, i in enumerate(seqs):
            for _, entry in step.snapshots[i]:  # this token ends a block
                pool.snap_conv[li, entry] = window[j, :, 1:]
                pool.snap_ssm[li, entry] = state[j]
        return o

    def _prefill(self, mixed, g, beta, step, i) -> torch.Tensor:
        pool, li, slot = step.pool, self.state_index, step.slots[i]
        n, width = mixed.shape[0], self.args.conv_kernel - 1
        xs = torch.cat([pool.conv[li, slot], mixed.float().t()], dim=-1)  # [C, K - 1 + n]
        conv_out = F.silu(F.conv1d(xs.unsqueeze(0), self.conv_weight.float().unsqueeze(1),
                                   groups=xs.shape[0])[0]).t()  # [n, C]
        pool.conv[li, slot] = xs[:, n : n + width]
        q, k, v = self._qkv(conv_out)
        keep = tuple(o for o, _ in step.snapshots[i])
        o, final, kept = chunk_gated_delta_rule(q, k, v, g, beta, pool.ssm[li, slot], step.starts[i], pool.chunk,
                                                keep)
        pool.ssm[li, slot] = final
        for (done, entry), state in zip(step.snapshots[i], kept):
            pool.snap_conv[li, entry] = xs[:, done : done + width]
            pool.snap_ssm[li, entry] = state
        return o

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm per head (weight w) times SiLU(z), as HF's Qwen3_5RMSNormGated: o [T, Hv, Dv] fp32."""
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.norm_weight
        return (w * o.to(w.dtype)).float() * F.silu(z.float())

    @torch.no_grad()
    def load_hf(self, take, p: str) -> None:
        """This layer's weights from HF names under `p` ("model.layers.{i}.linear_attn.")."""
        self.in_proj.weight.copy_(torch.cat([take(p + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")]))
        self.conv_weight.copy_(take(p + "conv1d.weight").squeeze(1))
        self.A_log.copy_(take(p + "A_log"))
        self.dt_bias.copy_(take(p + "dt_bias"))
        self.norm_weight.copy_(take(p + "norm.weight"))
        self.out_proj.weight.copy_(take(p + "out_proj.weight"))
