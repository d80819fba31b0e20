"""The mixture-of-experts feed-forward block of Mixtral, Qwen2-MoE / Qwen3-MoE and gpt-oss (`SparseMoE`), and
what a checkpoint's config says about it (`MoEArgs`).

A step's tokens [T, hidden] go through the router (a linear map to E expert logits, with a bias in
gpt-oss), each keeps its top k experts (`kernels.moe.route_topk`: softmax, top k, renormalized in Mixtral
and where Qwen's `norm_topk_prob` says; gpt-oss: softmax over the top k logits). The T * k assignments are
sorted by expert and the experts computed grouped (`kernels.moe.grouped_linear`, one GEMM per expert over
its rows): gate and up in one projection [E, 2I, hidden] (gate rows first), the activation, down
[E, hidden, I]; each assignment's output is scaled by its weight and a token's k outputs summed (in fp32,
in the order of its choices). Qwen2-MoE adds a shared expert, a dense SwiGLU MLP gated per token by
sigmoid(x . w).

Activations: SiLU(gate) * up (Mixtral, Qwen), or gpt-oss's clamped SwiGLU:
gate = min(gate, limit), up = clamp(up, -limit, limit), (up + 1) * gate * sigmoid(alpha * gate), as
transformers' GptOssExperts computes it (alpha 1.702, limit 7). gpt-oss stores gate and up interleaved
(columns 2i and 2i + 1 of x @ W); they are split into the gate-then-up rows at load.

Weights load from the checkpoint's names (per-expert tensors `experts.{j}.w1/w3/w2` or
`gate/up/down_proj`, fused `experts.gate_up_proj` as transformers holds them in memory, which is what
a GGUF conversion writes), and gpt-oss's MXFP4 experts (`*_blocks` 4-bit E2M1 values, two a byte, with
one power-of-two `*_scales` byte per 32).

Experts kept in blocks (`expert_blocks`, set by the loader before the weights load): "MXFP4" keeps a
checkpoint's MXFP4 experts as they ship (repacked once to ggml's MXFP4 blocks, `kernels.quant.mxfp4_from_ocp`,
gate and up rows reordered as bytes; no widened copy is made) and widens any other; "Q8_0" / "Q4_1"
(`--quantization int8 | int4`) quantize each expert as it loads (MXFP4 ones stay MXFP4: already 4.25 bits a
weight). The experts then run through `kernels.moe.grouped_quant_linear` (CPU) and `w13` / `w2` are empty. None:
widened to the model's dtype (`dequantize_mxfp4`), what a GPU and `quantization="none"` get.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from agentrt import kernels
from agentrt.kernels.linear import Linear, PackCache
from agentrt.kernels.moe import (ExpertPackCache, expert_placeholder, grouped_linear, grouped_quant_linear, route_topk,
                                 sort_by_expert)
from agentrt.kernels.quant import TYPE_IDS, QuantExperts, QuantWeight, mxfp4_from_ocp, quantize, quantize_experts

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_5_moe_text", "gpt_oss")
EXPERT_BLOCKS = ("MXFP4", "Q8_0", "Q4_1")  # SparseMoE.expert_blocks: the formats experts are kept in


@dataclass(slots=True, frozen=True)
class MoEArgs:
    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # of one expert
    renormalize: bool  # top-k weights divided by their sum (Mixtral; Qwen's norm_topk_prob)
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the mixture (the others a dense MLP)
    layout: str  # weight names and router: "mixtral", "qwen" or "gpt_oss"
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0 = none)
    swiglu_alpha: float = 1.702  # gpt-oss's clamped SwiGLU
    swiglu_limit: float = 7.0

    @property
    def gpt_oss(self) -> bool:
        return self.layout == "gpt_oss"

    @classmethod
    def from_hf(cls, cfg) -> MoEArgs | None:
        """The mixture a HF config describes, or None for a dense model."""
        t = cfg.model_type
        if t not in MOE_MODEL_TYPES:
            return None
        layers = range(cfg.num_hidden_layers)
        if t == "mixtral":
            return cls(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, True, tuple(layers),
                       "mixtral")
        if t == "gpt_oss":
            return cls(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, True, tuple(layers),
                       "gpt_oss", swiglu_alpha=float(getattr(cfg, "swiglu_alpha", 1.702)),
                       swiglu_limit=float(cfg.swiglu_limit))
        dense = set(getattr(cfg, "mlp_only_layers", None) or ())
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        sparse = tuple(i for i in layers if i not in dense and cfg.num_experts > 0 and (i + 1) % step == 0)
        renormalize = bool(getattr(cfg, "norm_topk_prob", True))  # Qwen3.5-MoE always renormalizes
        return cls(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, renormalize,
                   sparse, "qwen", shared_intermediate_size=int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0))


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, m: MoEArgs):
        super().__init__()
        self.args = m
        E, inter = m.num_experts, m.intermediate_size
        self.router = Linear(hidden_size, E, bias=m.gpt_oss)
        self.w13 = nn.Parameter(torch.empty(E, 2 * inter, hidden_size), requires_grad=False)  # gate rows, up rows
        self.w2 = nn.Parameter(torch.empty(E, hidden_size, inter), requires_grad=False)
        self.w13_bias = nn.Parameter(torch.empty(E, 2 * inter), requires_grad=False) if m.gpt_oss else None
        self.w2_bias = nn.Parameter(torch.empty(E, hidden_size), requires_grad=False) if m.gpt_oss else None
        self.w13_pack, self.w2_pack = ExpertPackCache(), ExpertPackCache()
        self.expert_blocks: str | None = None  # EXPERT_BLOCKS entry the experts load into, None = widened
        self.w13_quant: QuantExperts | None = None  # the experts in blocks (w13 and w2 then empty)
        self.w2_quant: QuantExperts | None = None
        if m.shared_intermediate_size:
            self.shared_gate_up = Linear(hidden_size, 2 * m.shared_intermediate_size, bias=False)
            self.shared_down = Linear(m.shared_intermediate_size, hidden_size, bias=False)
            self.shared_gate = Linear(hidden_size, 1, bias=False)
        else:
            self.shared_gate_up = self.shared_down = self.shared_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        m = self.args
        T = x.shape[0]
        weights, ids = route_topk(self.router(x), m.top_k, renormalize=m.renormalize, softmax_after_topk=m.gpt_oss)
        order, offsets = sort_by_expert(ids, m.num_experts)
        rows = x.index_select(0, order // m.top_k)  # [T * k, hidden], grouped by expert
        h = self._activate(self._experts(rows, offsets, self.w13, self.w13_quant, self.w13_bias, self.w13_pack))
        out = self._experts(h, offsets, self.w2, self.w2_quant, self.w2_bias, self.w2_pack)  # [T * k, hidden]
        by_choice = torch.empty_like(out)
        by_choice[order] = out
        y = (by_choice.view(T, m.top_k, -1).float() * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        if self.shared_gate_up is not None:
            shared = self.shared_down(self._silu_and_mul(self.shared_gate_up(x)))
            y = y + torch.sigmoid(self.shared_gate(x)) * shared
        return y

    @staticmethod
    def _experts(x: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor, quant: QuantExperts | None,
                 bias: torch.Tensor | None, cache: ExpertPackCache) -> torch.Tensor:
        if quant is not None:
            return grouped_quant_linear(x, offsets, quant, None if bias is None else cache.get_bias_f32(bias))
        return grouped_linear(x, offsets, w, bias, cache)

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        # gate_up: [rows, 2I], gate columns first -> [rows, I]
        if not self.args.gpt_oss:
            return self._silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        limit = self.args.swiglu_limit
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.args.swiglu_alpha))

    @staticmethod
    def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        if (gate_up.device.type == "cpu" and gate_up.dtype in (torch.float32, torch.bfloat16) and gate_up.is_contiguous()
                and (ops := kernels.cpu.ops()) is not None):
            return ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def free_unpacked(self) -> bool:
        """On CPU with the C++ kernels (fp32 or bf16): pack the expert weights and drop the unpacked ones
        (`w13`, `w2` become one-element placeholders of their shapes, `ExpertPackCache.adopt`), so the experts
        sit in memory once. Returns whether they were dropped. After it, only the C++ path runs this layer, and
        loading new weights into it is refused (the placeholders take no writes)."""
        w = self.w13
        if (self.w13_quant is not None or w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16)
                or kernels.cpu.ops() is None):
            return False
        for cache, param in ((self.w13_pack, self.w13), (self.w2_pack, self.w2)):
            if not cache.source_freed:
                cache.get(param)
                param.data = expert_placeholder(param)
                cache.adopt(param)
        return True

    def streamed_weights(self) -> list[tuple[PackCache, torch.Tensor]]:
        """(pack cache, weight) of the widened weights a decode step streams (every expert's, an upper bound;
        none of experts kept in blocks, `expert_bytes`)."""
        lins = [self.router] + ([self.shared_gate_up, self.shared_down] if self.shared_gate_up is not None else [])
        experts = [] if self.w13_quant is not None else [(self.w13_pack, self.w13), (self.w2_pack, self.w2)]
        return experts + [(lin.pack_cache, lin.weight) for lin in lins]

    def packed_experts(self) -> list[QuantExperts]:
        """The experts kept in blocks (w13's, w2's), or none."""
        return [q for q in (self.w13_quant, self.w2_quant) if q is not None]

    @torch.no_grad()
    def load_hf(self, sd: dict[str, torch.Tensor], prefix: str) -> None:
        """Pop this layer's mixture weights (`prefix` = "model.layers.{i}.") from a HF state dict."""
        take = _taker(sd)
        m = self.args
        if self.expert_blocks not in (None, *EXPERT_BLOCKS):
            raise ValueError(f"expert_blocks must be None or one of {', '.join(EXPERT_BLOCKS)}, "
                             f"got {self.expert_blocks!r}")
        hidden = self.router.weight.shape[1]
        if self.expert_blocks in ("Q8_0", "Q4_1") and (hidden % 32 or m.intermediate_size % 32):
            raise ValueError(f"{prefix}mlp: experts in {self.expert_blocks} blocks of 32 need in_features that are "
                             f"multiples of 32; gate/up take {hidden}, down {m.intermediate_size}")
        if m.gpt_oss:
            p = prefix + "mlp."
            self.router.weight.copy_(take(p + "router.weight"))
            self.router.bias.copy_(take(p + "router.bias"))
            # [E, 2I, H], gate and up interleaved: gate rows (even), then up rows (odd)
            gate_then_up = torch.cat([torch.arange(0, 2 * m.intermediate_size, 2),
                                      torch.arange(1, 2 * m.intermediate_size, 2)])
            gate_up = self._gpt_oss_experts(sd, take, p + "experts.gate_up_proj")
            if isinstance(gate_up, QuantExperts):
                gate_up = QuantExperts(gate_up.data[:, gate_then_up].contiguous(), gate_up.type_id, gate_up.shape)
            else:
                gate_up = gate_up[:, gate_then_up]
            self._set("w13", gate_up)
            self.w13_bias.copy_(take(p + "experts.gate_up_proj_bias")[:, gate_then_up])
            self._set("w2", self._gpt_oss_experts(sd, take, p + "experts.down_proj"))
            self.w2_bias.copy_(take(p + "experts.down_proj_bias"))
            return
        p = prefix + ("block_sparse_moe." if prefix + "block_sparse_moe.gate.weight" in sd else "mlp.")
        self.router.weight.copy_(take(p + "gate.weight"))
        if p + "experts.gate_up_proj" in sd:  # transformers' in-memory layout (a GGUF conversion's)
            self._set("w13", take(p + "experts.gate_up_proj"))
            self._set("w2", take(p + "experts.down_proj"))
        else:
            gate, up, down = ("w1", "w3", "w2") if m.layout == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            names = [(f"{p}experts.{j}.{gate}.weight", f"{p}experts.{j}.{up}.weight", f"{p}experts.{j}.{down}.weight")
                     for j in range(m.num_experts)]
            if self.expert_blocks in (None, "MXFP4"):  # widened (only gpt-oss ships MXFP4)
                for j, (g, u, d) in enumerate(names):
                    self.w13[j].copy_(torch.cat([take(g), take(u)]))
                    self.w2[j].copy_(take(d))
            else:  # one expert at a time into blocks: no widened stack
                fmt = self.expert_blocks
                self._set("w13", _stack([quantize(torch.cat([take(g), take(u)]), fmt) for g, u, _ in names]))
                self._set("w2", _stack([quantize(take(d), fmt) for _, _, d in names]))
        if self.shared_gate_up is not None:
            s = p + "shared_expert."
            self.shared_gate_up.weight.copy_(torch.cat([take(s + "gate_proj.weight"), take(s + "up_proj.weight")]))
            self.shared_down.weight.copy_(take(s + "down_proj.weight"))
            self.shared_gate.weight.copy_(take(p + "shared_expert_gate.weight"))

    def _set(self, name: str, w: torch.Tensor | QuantExperts) -> None:
        """Experts `name` ("w13" / "w2") from `w` [E, out, in]: kept as blocks if they are (and `expert_blocks` is
        set), quantized to `expert_blocks` if that is Q8_0 / Q4_1, else copied into the widened parameter."""
        param = getattr(self, name)
        if self.expert_blocks in ("Q8_0", "Q4_1") and not isinstance(w, QuantExperts):
            w = quantize_experts(w, self.expert_blocks)
        if not isinstance(w, QuantExperts):
            param.copy_(w)
            return
        if w.shape != tuple(param.shape):
            raise ValueError(f"experts {name}: the checkpoint's are {list(w.shape)}, the model's {list(param.shape)}")
        setattr(self, name + "_quant", w)
        setattr(self, name, nn.Parameter(torch.empty(0, dtype=param.dtype, device=param.device), requires_grad=False))

    def _gpt_oss_experts(self, sd: dict[str, torch.Tensor], take, name: str) -> torch.Tensor | QuantExperts:
        """gpt-oss's expert weight `name` as [E, out, in]: from MXFP4 blocks and scales (stored [E, out, in]) where
        the checkpoint has them (kept as blocks when `expert_blocks` is set, else widened), else the plain tensor
        (stored [E, in, out], x @ W's layout)."""
        if name + "_blocks" not in sd:
            return take(name).transpose(1, 2)
        blocks, scales = take(name + "_blocks"), take(name + "_scales")
        if self.expert_blocks is None:
            return dequantize_mxfp4(blocks, scales)
        e, n, groups, _ = blocks.shape
        return QuantExperts(mxfp4_from_ocp(blocks, scales), TYPE_IDS["MXFP4"], (e, n, groups * 32))


def _stack(parts: list[QuantWeight]) -> QuantExperts:
    """Per-expert blocks of one format (each [N, K]) as one [E, N, K] stack."""
    return QuantExperts(torch.stack([p.data for p in parts]), parts[0].type_id, (len(parts), *parts[0].shape))


def _taker(sd: dict[str, torch.Tensor]):
    def take(name: str) -> torch.Tensor:
        try:
            return sd.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint is missing weight {name!r}") from None

    return take


# The 16 values of a 4-bit E2M1 code (sign bit 3, then two exponent bits and one mantissa bit).
_FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 (OCP microscaling) -> dense: blocks [..., G, 16] uint8 (32 E2M1 codes per group of 32 values, low
    nibble first), scales [..., G] uint8 (the group's power of two, biased by 127) -> [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [..., G, 16] and scales [..., G] of uint8 expected, got "
                         f"{tuple(blocks.shape)} {blocks.dtype} and {tuple(scales.shape)} {scales.dtype}")
    lut = torch.tensor(_FP4_E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    values = torch.ldexp(lut[codes], scales.to(torch.int32).sub(127).unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)
