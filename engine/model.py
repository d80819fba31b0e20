"""Llama-family decoder (Llama, SmolLM 2 / 3, Mistral, Ministral, Qwen2, Qwen3, Gemma 2 / 3, Phi-3 layouts) over a
paged KV cache, built from a per-layer description (`ModelArgs`: each layer's window and rotary table).

RMSNorm, RoPE (any HF rope type, per layer type, partial rotary, or none: NoPE layers), GQA, SwiGLU or
GeLU-tanh gates, optional q/k/v and o biases, optional per-head RMSNorm of q and k before RoPE (Qwen3,
Gemma 3), tied embeddings. Gemma: norms applied as (1 + w) (stored so at load), norms after attention
and around the MLP, embeddings scaled by sqrt(hidden), query_pre_attn_scalar, soft-capped scores and
logits (Gemma 2). Per layer, attention takes a sliding window and learned sinks (gpt-oss) through
`kernels.paged_attention`. Ministral 3 scales q by its position-dependent attention temperature.
Q/K/V and gate/up projections are fused into one matmul each; q/k projection rows are reordered
at load time to adjacent (x1, x2) pairs, so RoPE on q and k together is one complex multiply (the
KV cache holds K in that order; q.k is unchanged). Attention goes through
`kernels` (Triton on CUDA, vectorized torch on CPU), so the GPU path is this same code.

On CPU in fp32 or bf16 with the C++ kernels built (kernels/cpu.py), a layer is nine calls: the
residual add fused into each RMSNorm (vLLM's `(hidden, residual)` layer interface), RoPE fused with
the KV-cache write, decode attention and small-row projections in C++, SiLU-and-mul in one pass.
In bf16 they round where HF's bf16 model rounds (kernels/csrc/elementwise.h).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from agentrt import kernels
from agentrt.engine.linear_attention import GatedDeltaNet, RecurrentSlot
from agentrt.engine.lora import LoRASlot
from agentrt.engine.model_args import ModelArgs, RopeFrequencies
from agentrt.engine.moe import SparseMoE
from agentrt.kernels.linear import (
    BF16_PACKED_MAX_ROWS,
    Linear,
    PackCache,
    linear,
    on_huge_pages,
)
from agentrt.kernels.paged_attention_cpu import CPP_MAX_QUERY_ROWS
from agentrt.kernels.quant import quant_embedding, quant_linear


def _cpu_ops(x: torch.Tensor):
    """The C++ CPU kernels (kernels.cpu) when they apply to x (2-D contiguous fp32 or bf16 on CPU), else None."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.is_contiguous():
        return kernels.cpu.ops()
    return None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with `residual`: (norm(x + residual), x + residual), the sum rounded to x's dtype."""
        if (ops := _cpu_ops(x)) is not None and x.dtype == self.weight.dtype:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            if residual.is_contiguous():
                return ops.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            return self.forward(x), x
        if x.dtype == torch.float32:  # one fused op, same math as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def interleave_rope_rows(w: torch.Tensor, num_heads: int, head_dim: int, rotary_dim: int = 0) -> torch.Tensor:
    """Reorder the output rows of a q or k projection (weight [heads*D, K] or bias [heads*D]) from
    HF's rotate-half pairing (i, i + R/2) of the first R = `rotary_dim` dims (default all) to adjacent pairs
    (2i, 2i + 1); the dims past R keep their order (their rotary angles are 0).

    Attention only sees q.k dot products, which do not change when q and k share one permutation of
    the head dim, so the model may keep q and k in this layout (the KV cache then holds K in it too);
    rotary embedding becomes one complex multiply per adjacent pair (`apply_rope`).
    """
    rot = rotary_dim or head_dim
    half = rot // 2
    order = torch.cat([torch.stack([torch.arange(half), torch.arange(half, rot)], dim=1).flatten(),  # 0, R/2, 1, ...
                       torch.arange(rot, head_dim)])
    return w.view(num_heads, head_dim, *w.shape[1:])[:, order].reshape(w.shape)


def apply_rope(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] in the adjacent-pair layout (any row stride); cis: [T, 1, D/2] complex64
    (cos + i sin). Pair (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), as HF's rotate-half, in fp32."""
    T, heads, D = x.shape
    x32 = x.float() if x.stride(-1) == 1 else x.float().contiguous()
    xc = torch.view_as_complex(x32.view(T, heads, D // 2, 2))
    return torch.view_as_real(xc * cis).view(T, heads, D).to(x.dtype)


@dataclass(slots=True)
class Rope:
    """The rotary angles of one forward's tokens, in the form the attention path wants."""

    positions: torch.Tensor  # [T] int64
    cos_sin: torch.Tensor | None  # C++ path: the whole table [max_position, head_dim / 2, 2] fp32
    cis: torch.Tensor | None  # torch path: [T, 1, head_dim / 2] complex64, this forward's rows
    q_scale: torch.Tensor | None = None  # [T, 1, 1] factor on q after RoPE (Ministral 3's temperature), or None


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, layer: int = 0, lora: LoRASlot | None = None):
        super().__init__()
        self.layer, self.lora = layer, lora or LoRASlot()  # LoRA adapters' rows of the current forward
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size, self.kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.qkv_proj = Linear(a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.qkv_bias)
        self.o_proj = Linear(self.q_size, a.hidden_size, bias=a.o_bias)
        self.scale = a.attn_scale or a.head_dim**-0.5
        self.rotary_dim = a.rotary_dim or a.head_dim
        # Qwen3, Gemma 3: q and k normalized per head (weights [head_dim], in the adjacent-pair rope layout)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        # this layer's kind: its window (None = full attention), its rotary table (None = NoPE)
        self.window = a.windows[layer] if a.windows else None
        self.rope_key = a.rope_keys[layer] if a.rope_keys else "default"
        self.softcap = a.attn_softcap
        self.sinks = nn.Parameter(torch.zeros(a.num_heads)) if a.attn_sinks else None  # gpt-oss, [H] logits
        # Qwen3.5: the output times sigmoid(x @ gate), the gate rows the second half of each head's q_proj rows
        self.gate_proj = Linear(a.hidden_size, self.q_size, bias=a.qkv_bias) if a.attn_output_gate else None

    def forward(self, x, rope: Rope, k_cache, v_cache, meta, slot_mapping):
        # x: [T, hidden]
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if (lb := self.lora.batch) is not None:
            lb.apply(self.layer, "qkv", x, qkv)
        if self.q_norm is not None:
            self._norm_qk(qkv)
        if (rope.cos_sin is not None and self.head_dim % 8 == 0 and (ops := _cpu_ops(qkv)) is not None
                and k_cache.dtype == qkv.dtype and k_cache.is_contiguous()):
            q = ops.rope_store_kv(qkv, rope.positions, rope.cos_sin, k_cache, v_cache, slot_mapping, self.num_heads)
        else:
            qk_size = self.q_size + self.kv_size
            qk = apply_rope(qkv[:, :qk_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim), rope.cis)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, qk_size:].view(T, self.num_kv_heads, self.head_dim)
            kernels.store_kv(k, v, k_cache, v_cache, slot_mapping)
        if rope.q_scale is not None:
            q = q * rope.q_scale
        o = kernels.paged_attention(q, k_cache, v_cache, meta, self.scale, window=self.window, sinks=self.sinks,
                                    softcap=self.softcap).reshape(T, self.q_size)
        if self.gate_proj is not None:
            o = o * torch.sigmoid(self.gate_proj(x))
        out = self.o_proj(o)
        if lb is not None:
            lb.apply(self.layer, "o", o, out)
        return out

    def streamed_weights(self) -> list[tuple[PackCache, torch.Tensor]]:
        return [(lin.pack_cache, lin.weight) for lin in (self.qkv_proj, self.o_proj)]

    def _norm_qk(self, qkv: torch.Tensor) -> None:
        """Qwen3's per-head RMSNorm of q and k, in place in the fused projection's output [T, q + 2 kv]."""
        T, D = qkv.shape[0], self.head_dim
        q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
        q.copy_(self.q_norm(q.reshape(T * self.num_heads, D)).view(T, self.q_size))
        k.copy_(self.k_norm(k.reshape(T * self.num_kv_heads, D)).view(T, self.kv_size))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs, layer: int = 0, lora: LoRASlot | None = None):
        super().__init__()
        self.layer, self.lora = layer, lora or LoRASlot()
        self.inter = a.intermediate_size
        self.act = a.hidden_act  # "silu" or "gelu_tanh"
        self.gate_up_proj = Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.down_proj = Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if (lb := self.lora.batch) is not None:
            lb.apply(self.layer, "gate_up", x, gate_up)
        if self.act == "gelu_tanh":
            gate, up = gate_up.split(self.inter, dim=-1)
            h = F.gelu(gate, approximate="tanh") * up
        elif (ops := _cpu_ops(gate_up)) is not None:
            h = ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.inter, dim=-1)
            h = F.silu(gate) * up
        out = self.down_proj(h)
        if lb is not None:
            lb.apply(self.layer, "down", h, out)
        return out

    def streamed_weights(self) -> list[tuple[PackCache, torch.Tensor]]:
        return [(lin.pack_cache, lin.weight) for lin in (self.gate_up_proj, self.down_proj)]


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, layer: int = 0, lora: LoRASlot | None = None,
                 recurrent: RecurrentSlot | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        # the token mixer: attention, or a hybrid model's linear attention (its recurrent state in `recurrent`)
        if a.layer_kinds and a.layer_kinds[layer] == "linear_attention":
            self.self_attn = GatedDeltaNet(a.hidden_size, a.linear, a.rms_norm_eps,
                                           a.layer_kinds[:layer].count("linear_attention"), recurrent)
        else:
            self.self_attn = Attention(a, layer, lora)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        # Gemma 2 / 3: the attention output is normed before the residual add, and the MLP sits between two norms
        sandwich = a.sandwich_norms
        self.pre_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps) if sandwich else None
        self.post_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps) if sandwich else None
        sparse = a.moe is not None and layer in a.moe.sparse_layers
        self.mlp = SparseMoE(a.hidden_size, a.moe) if sparse else MLP(a, layer, lora)

    def streamed_weights(self) -> list[tuple[PackCache, torch.Tensor]]:
        return self.self_attn.streamed_weights() + self.mlp.streamed_weights()

    def forward(self, x, residual, rope, k_cache, v_cache, meta, slot_mapping):
        # x: [T, hidden], the previous layer's output, and residual its input stream (None at layer 0)
        # -> (this layer's output, its residual stream); the stream is x + residual, summed in the norm
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, k_cache, v_cache, meta, slot_mapping)
        if self.post_feedforward_layernorm is not None:
            x = self.post_attention_layernorm(x)
            x, residual = self.pre_feedforward_layernorm(x, residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.kv_slots: list[tuple[int, int] | None] | None = None  # per layer (group, page slot); None = layer i at i
        self.args = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.lora = LoRASlot()  # the runner sets .batch around a forward whose rows use LoRA adapters
        # a hybrid model's runner sets .step around a forward (engine.recurrent_state.RecurrentStep)
        self.recurrent = RecurrentSlot()
        self.layers = nn.ModuleList(DecoderLayer(a, i, self.lora, self.recurrent) for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = None if a.tie_word_embeddings else Linear(a.hidden_size, a.vocab_size, bias=False)
        # a sequence classifier's head: class logits of the last token's final-norm hidden state (`classify`)
        self.score = Linear(a.hidden_size, a.num_labels, bias=False) if a.num_labels else None
        self._tied_head_pack = PackCache()  # packed embedding matrix for the CPU packed_linear
        # rotary table cos + i sin, complex64 whatever the model dtype: [max_position, head_dim / 2].
        # A plain attribute, not a buffer, so that `model.to(dtype)` leaves it complex; set by init_rope(s).
        # rope_tables: every table the layers use by key (None: NoPE's, all ones), as (cis, cos_sin);
        # rope_cis / rope_cos_sin: the "default" one (the fused decode step's).
        self.rope_tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rope_cis: torch.Tensor | None = None
        self.rope_cos_sin: torch.Tensor | None = None
        self._decode_cache: tuple | None = None  # see _decode_weights
        self._decode_quant_types: list[int] = []  # see _decode_weights
        self._packs_homed = False  # see _packs_on_huge_pages
        self.batch_invariant = False  # see set_batch_invariant
        # projections kept in GGUF block formats (engine.gguf_weights.pack_model): no fused C++ decode step, no
        # packed copies; a tied model's LM head from the file's token embedding blocks (`tied_head_quant`)
        self.quantized = False
        self.tied_head_quant: tuple | None = None
        self.embed_quant = None  # the token embedding's blocks (kernels.quant.QuantWeight), looked up row by row

    def set_batch_invariant(self, on: bool) -> None:
        """The engine's deterministic mode: every projection (kernels.linear) and the attention of every step
        (the runner's metadata) compute a row the same way whatever else the step holds."""
        self.batch_invariant = bool(on)
        for m in self.modules():
            if isinstance(m, Linear):
                m.batch_invariant = self.batch_invariant

    @torch.no_grad()
    def init_rope(self, inv_freq: torch.Tensor, scaling: float) -> None:
        """Fill the one rotary table of a model whose layers share it, from its inverse frequencies and
        attention scaling (after the model is on its device)."""
        self.init_ropes({"default": RopeFrequencies(inv_freq, scaling)})

    @torch.no_grad()
    def init_ropes(self, freqs: dict[str, RopeFrequencies]) -> None:
        """Fill every rotary table the layers use (`model_args.rope_frequencies`), after the model is on its
        device. A table covers the first `len(inv_freq) * 2` dims of a head (partial rotary: the rest
        get angle 0, cos 1 and sin 0, unscaled)."""
        half, n = self.args.head_dim // 2, self.args.max_position
        pos = torch.arange(n, dtype=torch.float32)
        keys = set(self.args.rope_keys or ("default",))
        tables: dict[str | None, torch.Tensor] = {}
        for key, f in freqs.items():
            angles = torch.outer(pos, f.inv_freq.float())
            if f.long_inv_freq is not None:
                angles[f.long_from :] = torch.outer(pos[f.long_from :], f.long_inv_freq.float())
            cis = torch.ones(n, half, dtype=torch.complex64)
            cis[:, : angles.shape[1]] = torch.complex(angles.cos() * f.scaling, angles.sin() * f.scaling)
            tables[key] = cis
        if None in keys:
            tables[None] = torch.ones(n, half, dtype=torch.complex64)
        missing = keys - set(tables)
        if missing:
            raise ValueError(f"no rotary frequencies for the layers' tables {sorted(map(str, missing))}")
        device = self.embed_tokens.weight.device
        self.rope_tables = {k: (c.to(device), torch.view_as_real(c.to(device))) for k, c in tables.items() if k in keys}
        # [max_position, head_dim / 2, 2] fp32 views of the same storage
        self.rope_cis, self.rope_cos_sin = self.rope_tables.get("default", next(iter(self.rope_tables.values())))

    def forward(self, input_ids, positions, kv_cache, meta, slot_mapping) -> torch.Tensor:
        # input_ids, positions, slot_mapping: [T]; kv_cache: [L, 2, num_blocks, block_size, kv_heads, D]
        x = (self.embed_tokens(input_ids) if self.embed_quant is None
             else quant_embedding(input_ids, self.embed_quant).to(self.embed_tokens.weight.dtype))
        if self.args.embed_scale is not None:
            x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype)
        if (ops := _cpu_ops(x)) is not None and not torch.is_grad_enabled():
            self._packs_on_huge_pages()
        if (ops is not None and self.lora.batch is None and not isinstance(meta, list)
                and self._decode_fusable(x.shape[0], meta.max_query_len, kv_cache)):
            a = self.args
            return ops.decode_forward(x, *self._decode_weights(), kv_cache, positions, slot_mapping, self.rope_cos_sin,
                                      meta.query_start_loc, meta.seq_lens, meta.block_tables, a.num_heads,
                                      a.intermediate_size, a.rms_norm_eps, self.layers[0].self_attn.scale,
                                      meta.batch_invariant, self._decode_quant_types)
        q_scale = None
        if (temperature := self.args.attn_temperature) is not None:
            beta, span = temperature
            q_scale = (1 + beta * torch.log1p(torch.floor(positions.float() / span))).to(x.dtype).view(-1, 1, 1)
        ropes = {key: Rope(positions, cos_sin, None, q_scale) if ops is not None
                 else Rope(positions, None, cis[positions].unsqueeze(1), q_scale)
                 for key, (cis, cos_sin) in self.rope_tables.items()}
        residual = None
        if isinstance(meta, list):  # layer groups (engine.kv_layout): each layer reads its group's page slot and table
            for layer, place in zip(self.layers, self.kv_slots, strict=True):
                g, j = place if place is not None else (0, 0)
                x, residual = layer(x, residual, ropes[layer.self_attn.rope_key], kv_cache[j, 0], kv_cache[j, 1],
                                    meta[g], slot_mapping[g])
            return x + residual
        for i, layer in enumerate(self.layers):
            j = i if self.kv_slots is None else (self.kv_slots[i] or (0, 0))[1]  # a layer without KV: unused
            x, residual = layer(x, residual, ropes[layer.self_attn.rope_key], kv_cache[j, 0], kv_cache[j, 1], meta,
                                slot_mapping)
        return x + residual  # [T, hidden], before the final norm

    def set_kv_layout(self, layout) -> None:
        """Where each layer's K/V live (engine.kv_layout.KVLayout): its group's table and its slot in a page."""
        slots = layout.layer_slots()
        self.kv_slots = None if slots == [(0, i) for i in range(len(self.layers))] else slots

    def _decode_fusable(self, rows: int, max_query_len: int, kv_cache: torch.Tensor) -> bool:
        """Whether a step of `rows` rows can run as one `decode_forward` call: decode rows (at most 16 per
        sequence, the C++ attention's), few enough for the packed projections, a head_dim and layout the
        C++ kernels take (the cache in the model's dtype), and Llama's layer layout exactly (`ModelArgs.plain`).
        Packed GGUF weights (`quantized`) too, as bf16 on an AVX512-BF16 build (kernels/csrc/quant_bf16.h)."""
        if not self.args.plain or self.args.moe is not None or (self.quantized and not self._quant_fusable()):
            return False
        return (max_query_len <= CPP_MAX_QUERY_ROWS and rows <= BF16_PACKED_MAX_ROWS
                and self.args.head_dim in (32, 64, 128, 256) and self.args.num_heads <= 64
                and kv_cache.dtype == self.embed_tokens.weight.dtype and kv_cache.is_contiguous())

    def _quant_fusable(self) -> bool:
        """Whether `decode_forward` takes this model's packed GGUF weights: every projection packed, bf16, and
        the kernels built with AVX512-BF16."""
        lins = [lin for layer in self.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                         layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        return (self.embed_tokens.weight.dtype == torch.bfloat16 and kernels.cpu.compiled_isa() == "avx512_bf16"
                and all(getattr(lin, "quant", None) is not None for lin in lins)
                and (self.lm_head is None or len(self.lm_head.quant or ()) == 1))

    def _decode_weights(self) -> tuple:
        """Per-layer weight lists of `decode_forward`, packed; built on the first decode step and dropped
        when weights are loaded or the model is moved (the engine never changes them in between). A packed
        GGUF model's lists are its projections' block parts, their ggml types in `_decode_quant_types`."""
        if self._decode_cache is None:
            bf16 = self.embed_tokens.weight.dtype == torch.bfloat16
            self._decode_quant_types = []

            def packed(lin: Linear) -> torch.Tensor | None:
                return None if self.quantized else lin.pack_cache.get(lin.weight)  # packed GGUF: the parts below

            def bias(lin: Linear) -> torch.Tensor | None:
                return None if lin.bias is None else (lin.pack_cache.get_bias_f32(lin.bias) if bf16 else lin.bias)

            ls = self.layers
            self._decode_cache = (
                [layer.input_layernorm.weight for layer in ls], [packed(layer.self_attn.qkv_proj) for layer in ls],
                [bias(layer.self_attn.qkv_proj) for layer in ls], [packed(layer.self_attn.o_proj) for layer in ls],
                [layer.post_attention_layernorm.weight for layer in ls], [packed(layer.mlp.gate_up_proj) for layer in ls],
                [packed(layer.mlp.down_proj) for layer in ls],
                [n.weight for layer in ls if layer.self_attn.q_norm is not None
                 for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)])  # Qwen3's, else empty
            if self.quantized:  # each projection's parts, flat, in the order decode_forward reads their types
                kinds = [[layer.self_attn.qkv_proj for layer in ls], [layer.self_attn.o_proj for layer in ls],
                         [layer.mlp.gate_up_proj for layer in ls], [layer.mlp.down_proj for layer in ls]]
                parts = [[p for lin in kind for p in lin.quant] for kind in kinds]
                c = self._decode_cache
                self._decode_cache = (c[0], [p.data for p in parts[0]], c[2], [p.data for p in parts[1]], c[4],
                                      [p.data for p in parts[2]], [p.data for p in parts[3]], c[7])
                self._decode_quant_types = [p.type_id for kind in parts for p in kind]
        return self._decode_cache

    def streamed_weights(self) -> list[tuple[PackCache, torch.Tensor]]:
        """(pack cache, weight) of every weight a decode step streams: each layer's projections, then the
        LM head (the embedding when tied)."""
        return [c for layer in self.layers for c in layer.streamed_weights()] + [self._head_weights()]

    def _head_weights(self) -> tuple[PackCache, torch.Tensor]:
        return ((self.lm_head.pack_cache, self.lm_head.weight) if self.lm_head is not None
                else (self._tied_head_pack, self.embed_tokens.weight))

    def _packs_on_huge_pages(self) -> None:
        """Pack every weight a decode step streams (the LM head's included) and move the packed copies
        to huge pages (kernels.linear.on_huge_pages: ~1.2-1.7x the streaming rate of one-row
        projections); once per set of weights, before the first CPU forward with the C++ kernels."""
        if self._packs_homed or self.quantized:
            return
        # a layer at a time (a mapping each), a mixture's unpacked experts dropped once its packs are homed
        # (SparseMoE.free_unpacked): packing then holds one layer's packed copy twice, not the model's
        head = self._head_weights()
        for layer, group in [*((layer, layer.streamed_weights()) for layer in self.layers), (None, [head])]:
            for cache, copy in zip((c for c, _ in group), on_huge_pages([c.get(w) for c, w in group]), strict=True):
                cache.rehome(copy)
            if layer is not None and isinstance(layer.mlp, SparseMoE):
                layer.mlp.free_unpacked()
        self._packs_homed = True

    def _apply(self, fn, recurse=True):
        self._decode_cache = None
        self._packs_homed = False
        return super()._apply(fn, recurse)

    @torch.inference_mode()
    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Class probabilities [N, num_labels] (fp32) of final-norm hidden states [N, hidden] (a sequence
        classifier's last-token pooling), as HF's *ForSequenceClassification then a softmax."""
        if self.score is None:
            raise ValueError("this model has no classification head (a *ForSequenceClassification checkpoint has one)")
        w = self.score.weight
        return (pooled.to(device=w.device, dtype=w.dtype) @ w.t()).float().softmax(dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] rows to sample from -> [N, vocab]
        h = self.norm(hidden)
        if self.lm_head is not None:
            logits = self.lm_head(h)
        elif self.tied_head_quant is not None:
            logits = quant_linear(h, self.tied_head_quant, None, self.batch_invariant)
        else:
            logits = linear(h, self.embed_tokens.weight, None, self._tied_head_pack, self.batch_invariant)
        if (cap := self.args.final_softcap) is not None:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def decode_steps(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                     block_tables: torch.Tensor, stop_ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy decode of R one-row sequences, up to `steps` steps, each step's argmax the next step's
        input (the runner's multi-step decode): input_ids, positions [R] int64 (each row's last token
        and its position); block_tables [R, W] int32 covering positions .. positions + steps - 1 (-1
        past a row's blocks); stop_ids [R, S] int64 (-1 = none). Returns (tokens [R, steps] int64,
        counts [R] int64): a row's tokens up to and including its first stop id; the loop ends when
        every row has stopped. The same numbers as `steps` calls of forward, compute_logits and
        argmax: on CPU with the C++ kernels, one `decode_steps` call (kernels/csrc/cpu_ops.cpp)."""
        rows, a = input_ids.shape[0], self.args
        w = self.embed_tokens.weight
        ops = _cpu_ops(w) if self.embed_quant is None else (kernels.cpu.ops() if w.device.type == "cpu" else None)
        if ops is not None:
            self._packs_on_huge_pages()
        if (ops is not None and self.lora.batch is None and self._decode_fusable(rows, 1, kv_cache)
                and self.norm.weight.dtype == w.dtype):
            head_q = self.lm_head.quant if self.lm_head is not None else self.tied_head_quant
            head = (head_q[0].data if head_q is not None and len(head_q) == 1
                    else self.lm_head.pack_cache.get(self.lm_head.weight) if self.lm_head is not None
                    else self._tied_head_pack.get(w))
            embed = w if self.embed_quant is None else self.embed_quant.data
            weights = self._decode_weights()
            quant_types = self._decode_quant_types
            if self.quantized:  # then the embedding's and the LM head's types (0: widened)
                quant_types = [*quant_types, 0 if self.embed_quant is None else self.embed_quant.type_id,
                               0 if head_q is None else head_q[0].type_id]
            return ops.decode_steps(input_ids, embed, *weights, kv_cache, positions, self.rope_cos_sin,
                                    block_tables, self.norm.weight, head, a.vocab_size, stop_ids, steps, a.num_heads,
                                    a.intermediate_size, a.rms_norm_eps, self.layers[0].self_attn.scale,
                                    self.batch_invariant, quant_types)
        dev, bs = input_ids.device, kv_cache.shape[3]
        grouped = isinstance(block_tables, list)  # one table per layer group (engine.kv_layout)
        group_tables = block_tables if grouped else [block_tables]
        last = (positions + steps - 1) // bs  # a row's blocks are a prefix of its table row
        for table in group_tables:
            width = table.shape[1]
            missing = (last >= width) | (table.gather(1, last.clamp(max=width - 1).unsqueeze(1)).squeeze(1) < 0)
            if bool(missing.any()):
                r = int(missing.nonzero()[0])
                raise RuntimeError(f"decode_steps: row {r} at position {int(positions[r])} has no block table entry "
                                   f"for {steps} steps")
        tokens = torch.zeros(rows, steps, dtype=torch.long, device=dev)
        counts = torch.full((rows,), steps, dtype=torch.long, device=dev)
        done = torch.zeros(rows, dtype=torch.bool, device=dev)
        ids, pos = input_ids.clone(), positions.clone()
        tables = [t.long() for t in group_tables]
        qsl = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        for j in range(steps):
            slots = [t.gather(1, (pos // bs).unsqueeze(1)).squeeze(1) * bs + pos % bs for t in tables]
            metas = [kernels.build_attention_metadata(query_start_loc=qsl, seq_lens=(pos + 1).int(),
                                                      block_tables=t, max_query_len=1,
                                                      max_seq_len=int(pos.max()) + 1,
                                                      batch_invariant=self.batch_invariant) for t in group_tables]
            if not grouped:
                metas, slots = metas[0], slots[0]
            logits = self.compute_logits(self.forward(ids, pos, kv_cache, metas, slots))
            # on CPU max's indices are argmax's (the first maximum, a NaN largest) without an fp32 copy of the
            # logits, at ~1/4 of argmax's time ([64, 262144] bf16, Gemma 3's vocabulary: 26 vs 112 ms, 1 thread)
            ids = logits.max(dim=-1).indices if logits.device.type == "cpu" else logits.float().argmax(dim=-1)
            tokens[:, j] = ids
            pos = pos + 1
            stopped = (ids.unsqueeze(1) == stop_ids).any(dim=1) & ~done
            counts[stopped] = j + 1
            done |= stopped
            if bool(done.all()):
                break
        return tokens, counts

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor], loaded: Callable[[int], None] | None = None) -> None:
        """Load HF Llama-layout weight names (Llama, Qwen, Mistral, Gemma, SmolLM3; Phi-3's fused qkv_proj and
        gate_up_proj; Gemma 3's multimodal checkpoints' language model), fusing q/k/v and gate/up. `loaded(-1)` is
        called once the embedding, final norm and LM head are in, `loaded(i)` once layer i's weights are (the
        GGUF packer swaps them for blocks there, so no layer's widened projections outlive its turn)."""
        a = self.args
        loaded = loaded or (lambda i: None)

        def take(name):
            try:
                return sd.pop(name)
            except KeyError:
                raise ValueError(f"checkpoint is missing weight {name!r}") from None

        def norm(name):  # Gemma's norms multiply by 1 + w: stored so
            w = take(name)
            return w.float() + 1 if a.gemma_norms else w

        sd = _language_model_weights(sd)

        self._decode_cache = None
        self._packs_homed = False
        if "model.embed_tokens.weight" not in sd and "embed_tokens.weight" in sd:
            # a base model's checkpoint (HF AutoModel, e.g. an embedding model): no "model." prefix, no LM head
            sd = {f"model.{k}" if not k.startswith("lm_head.") else k: v for k, v in sd.items()}
        self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
        self.norm.weight.copy_(norm("model.norm.weight"))
        if self.lm_head is not None:
            self.lm_head.weight.copy_(sd.pop("lm_head.weight", None) if "lm_head.weight" in sd else self.embed_tokens.weight)
        sd.pop("lm_head.weight", None)
        if self.score is not None:
            self.score.weight.copy_(take("score.weight"))
        loaded(-1)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm"):
                if (module := getattr(layer, name)) is not None:
                    module.weight.copy_(norm(p + f"{name}.weight"))
            att = layer.self_attn
            if isinstance(att, GatedDeltaNet):  # a hybrid model's linear-attention layer
                att.load_hf(take, p + "linear_attn.")
            else:
                heads = {"q": att.num_heads, "k": att.num_kv_heads}
                for kind in ("weight", "bias") if att.qkv_proj.bias is not None else ("weight",):
                    if p + f"self_attn.qkv_proj.{kind}" in sd:  # Phi-3: q, k, v in one projection
                        parts = list(take(p + f"self_attn.qkv_proj.{kind}").split([att.q_size, att.kv_size,
                                                                                   att.kv_size]))
                    else:
                        parts = [take(p + f"self_attn.{n}_proj.{kind}") for n in "qkv"]
                    if att.gate_proj is not None:  # Qwen3.5: per head, D query rows then D gate rows
                        q_gate = parts[0].view(att.num_heads, 2, att.head_dim, *parts[0].shape[1:])
                        parts[0] = q_gate[:, 0].reshape(att.q_size, *parts[0].shape[1:])
                        getattr(att.gate_proj, kind).copy_(q_gate[:, 1].reshape(att.q_size, *parts[0].shape[1:]))
                    parts[:2] = [interleave_rope_rows(t, heads[n], att.head_dim, att.rotary_dim)
                                 for n, t in zip("qk", parts)]
                    getattr(att.qkv_proj, kind).copy_(torch.cat(parts))
                att.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
                if att.o_proj.bias is not None:
                    att.o_proj.bias.copy_(take(p + "self_attn.o_proj.bias"))
                if att.sinks is not None:
                    att.sinks.copy_(take(p + "self_attn.sinks"))
                if att.q_norm is not None:  # same rope layout as the q and k rows
                    for n, qk_norm in (("q", att.q_norm), ("k", att.k_norm)):
                        qk_norm.weight.copy_(interleave_rope_rows(norm(p + f"self_attn.{n}_norm.weight"), 1,
                                                                  att.head_dim, att.rotary_dim))
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.load_hf(sd, p)
            else:
                if p + "mlp.gate_up_proj.weight" in sd:  # Phi-3: gate and up in one projection, gate rows first
                    layer.mlp.gate_up_proj.weight.copy_(take(p + "mlp.gate_up_proj.weight"))
                else:
                    layer.mlp.gate_up_proj.weight.copy_(torch.cat([take(p + "mlp.gate_proj.weight"),
                                                                   take(p + "mlp.up_proj.weight")]))
                layer.mlp.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
            loaded(i)
        leftover = [k for k in sd if "rotary_emb" not in k]
        if leftover:
            raise ValueError(f"checkpoint has weights this model does not use: {leftover[:5]}")

_MULTIMODAL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head."))
_OTHER_MODALITIES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.",
                     "model.visual.", "visual.", "mtp.")  # Qwen3.5's vision tower and multi-token-prediction head


def _language_model_weights(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A multimodal checkpoint's (Gemma 3's) language-model weights under the text model's names; other
    checkpoints unchanged."""
    if not any(k.startswith(old) for k in sd for old, _ in _MULTIMODAL_PREFIXES):
        return sd
    out = {}
    for k, v in sd.items():
        if k.startswith(_OTHER_MODALITIES):
            continue
        for old, new in _MULTIMODAL_PREFIXES:
            if k.startswith(old):
                k = new + k[len(old):]
                break
        out[k] = v
    return out
