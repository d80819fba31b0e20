"""What a checkpoint's HF config says about the network `engine.model` builds: its shapes and layout
(`ModelArgs`), each layer's kind (`layer_types`: sliding window or full attention, its rotary table or
none), and its rotary frequencies (any rope type transformers knows, per layer type where the config
gives several, partial rotary). The context is the model's own (`max_position_embeddings`): a sliding
window is a property of a layer's attention, not a cap."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from agentrt.engine.linear_attention import LINEAR_MODEL_TYPES, LinearAttentionArgs
from agentrt.engine.moe import MoEArgs


@dataclass(slots=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int  # positions the rotary table covers (the model's context)
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 layout
    qk_norm: bool = False  # Qwen3 layout: RMSNorm over each head of q and of k, before RoPE
    num_labels: int = 0  # a *ForSequenceClassification checkpoint's classes (its `score` head); 0 = none
    # Per layer (one entry each; empty = every layer full attention on the "default" rotary table):
    windows: tuple[int | None, ...] = ()  # a sliding-window layer sees its last W positions; None = all of them
    rope_keys: tuple[str | None, ...] = ()  # the rotary table a layer uses (`rope_frequencies`); None = NoPE
    # Layout features (defaults: the Llama layout):
    attn_scale: float | None = None  # softmax scale; None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # scores c * tanh(s / c) (Gemma 2)
    final_softcap: float | None = None  # logits c * tanh(l / c) (Gemma 2)
    attn_sinks: bool = False  # a learned logit per head in the softmax denominator (gpt-oss `self_attn.sinks`)
    o_bias: bool = False  # a bias on o_proj (`attention_bias` of Llama-layout configs, gpt-oss)
    rotary_dim: int = 0  # leading dims of a head that rotate (partial rotary, Phi-3); 0 = all
    gemma_norms: bool = False  # RMSNorm weights applied as 1 + w (stored so at load)
    sandwich_norms: bool = False  # norms after attention and around the MLP too (Gemma 2 / 3)
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden), rounded to the model dtype)
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" or "gelu_tanh"
    attn_temperature: tuple[float, int] | None = None  # Ministral 3: q *= 1 + beta * log(1 + floor(pos / n))
    # Hybrid decoders (Qwen3.5): per layer "attention" or "linear_attention" (a Gated DeltaNet layer with a recurrent
    # state and no KV, engine.linear_attention); empty = every layer attention
    layer_kinds: tuple[str, ...] = ()
    attn_output_gate: bool = False  # attention output times sigmoid(gate), the gate a second half of q_proj (Qwen3.5)
    linear: LinearAttentionArgs | None = None  # the linear-attention layers' shapes

    @property
    def plain(self) -> bool:
        """Llama's layout exactly (what the fused C++ decode step computes): full attention, one rotary
        table over whole heads, none of the features above."""
        return (all(w is None for w in self.windows) and all(k == "default" for k in self.rope_keys)
                and self.attn_scale is None and self.attn_softcap is None and self.final_softcap is None
                and not self.attn_sinks and not self.o_bias and self.rotary_dim in (0, self.head_dim)
                and not self.gemma_norms and not self.sandwich_norms and self.embed_scale is None
                and self.hidden_act == "silu" and self.attn_temperature is None and not self.attn_output_gate
                and self.linear is None)
    moe: MoEArgs | None = None  # the mixture of experts of Mixtral, Qwen-MoE, gpt-oss (engine.moe); None = dense

    @classmethod
    def from_hf(cls, cfg) -> ModelArgs:
        cfg = text_config(cfg)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            **_layer_description(cfg, head_dim),
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            # Qwen3.5-MoE has no dense MLP (every layer a mixture)
            intermediate_size=getattr(cfg, "intermediate_size", None) or cfg.moe_intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
                     or bool(getattr(cfg, "qkv_bias", False)),  # Qwen2-MoE's name
            qk_norm=cfg.model_type == "gemma3_text" or cfg.model_type in ("qwen3", "qwen3_moe", *LINEAR_MODEL_TYPES),
            num_labels=cfg.num_labels if any(a.endswith("ForSequenceClassification")
                                             for a in getattr(cfg, "architectures", None) or ()) else 0,
            moe=MoEArgs.from_hf(cfg),
        )


GEMMA_TYPES = ("gemma2", "gemma3_text")
MULTIMODAL_TYPES = ("gemma3", "qwen3_5", "qwen3_5_moe")  # configs whose decoder is their `text_config`


def text_config(cfg):
    """The decoder's config: a multimodal config's text part (Gemma 3's, Qwen3.5's `text_config`), else cfg."""
    if cfg.model_type in MULTIMODAL_TYPES and getattr(cfg, "text_config", None) is not None:
        return cfg.text_config
    return cfg


def layer_windows(cfg) -> tuple[int | None, ...]:
    """Each layer's sliding window (it attends to its last W positions) or None (full attention), from
    `layer_types` and `sliding_window` (HF's convention: a query at p sees keys k with k > p - W)."""
    n, window = cfg.num_hidden_layers, getattr(cfg, "sliding_window", None) or None
    if cfg.model_type in ("qwen2", "qwen3", "smollm3") and not getattr(cfg, "use_sliding_window", False):
        window = None
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return (int(window) if window else None,) * n
    if len(types) != n:
        raise ValueError(f"config has {len(types)} layer_types for {n} layers")
    bad = sorted(set(types) - {"sliding_attention", "full_attention", "linear_attention"})
    if bad:
        raise ValueError(f"unsupported layer type {bad[0]!r} in layer_types: expected sliding_attention, "
                         "full_attention or linear_attention")
    return tuple(int(window) if t == "sliding_attention" and window else None for t in types)


def _per_layer_type_rope(cfg) -> bool:
    params, types = getattr(cfg, "rope_parameters", None) or {}, getattr(cfg, "layer_types", None) or ()
    return bool(types) and all(isinstance(params.get(t), dict) for t in set(types))


def rotary_dim(cfg, head_dim: int) -> int:
    params = getattr(cfg, "rope_parameters", None) or {}
    if _per_layer_type_rope(cfg):
        params = {}
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0)
    return int(head_dim * factor)


def _layer_description(cfg, head_dim: int) -> dict:
    """The ModelArgs fields past the shapes: per-layer kinds and the layout's features."""
    t, n = cfg.model_type, cfg.num_hidden_layers
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(f"{t!r} config with use_bidirectional_attention (an embedding model) is not a causal "
                         "decoder the engine serves")
    if _per_layer_type_rope(cfg):
        keys = tuple(cfg.layer_types)
    else:
        keys = ("default",) * n
    if t == "smollm3":  # no_rope_layers[i] == 0: layer i uses no rotary embedding
        keys = tuple(k if use else None for k, use in zip(keys, cfg.no_rope_layers, strict=True))
    gemma = t in GEMMA_TYPES
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    acts = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
    if act not in acts:
        raise ValueError(f"unsupported MLP activation {act!r} in {t!r} config: expected one of {', '.join(acts)}")
    temperature = None
    params = getattr(cfg, "rope_parameters", None) or {}
    if t == "ministral3" and params.get("llama_4_scaling_beta") is not None:
        temperature = (float(params["llama_4_scaling_beta"]), int(params["original_max_position_embeddings"]))
    scalar = getattr(cfg, "query_pre_attn_scalar", None) if gemma else None
    linear = LinearAttentionArgs.from_hf(cfg)
    kinds = tuple("linear_attention" if k == "linear_attention" else "attention"
                  for k in getattr(cfg, "layer_types", None) or ()) if linear is not None else ()
    if linear is None and "linear_attention" in (getattr(cfg, "layer_types", None) or ()):
        raise ValueError(f"{t!r} config has linear_attention layers: the engine runs them for "
                         f"{', '.join(LINEAR_MODEL_TYPES)} only")
    return dict(
        layer_kinds=kinds,
        attn_output_gate=linear is not None,  # Qwen3.5's gated attention
        linear=linear,
        windows=layer_windows(cfg),
        rope_keys=keys,
        attn_scale=float(scalar) ** -0.5 if scalar else None,
        attn_softcap=getattr(cfg, "attn_logit_softcapping", None) or None,
        final_softcap=getattr(cfg, "final_logit_softcapping", None) or None,
        attn_sinks=t == "gpt_oss",
        o_bias=bool(getattr(cfg, "attention_bias", False)) and t not in ("qwen2", "qwen3"),
        rotary_dim=rotary_dim(cfg, head_dim),
        gemma_norms=gemma or linear is not None,  # Qwen3.5's norms are 1 + w too (q/k norms included)
        sandwich_norms=gemma,
        embed_scale=math.sqrt(cfg.hidden_size) if gemma else None,
        hidden_act=acts[act],
        attn_temperature=temperature,
    )


@dataclass(slots=True)
class RopeFrequencies:
    """One rotary table's frequencies (transformers' rope functions give them)."""

    inv_freq: torch.Tensor  # [rotary_dim / 2] fp32
    scaling: float  # attention factor multiplying cos and sin
    long_inv_freq: torch.Tensor | None = None  # LongRoPE: the frequencies of positions >= long_from
    long_from: int = 0


def rope_frequencies(hf_config, args: ModelArgs) -> dict[str, RopeFrequencies]:
    """The rotary tables the layers use (`args.rope_keys`), by key."""
    cfg = text_config(hf_config)
    out = {}
    for key in sorted({k for k in args.rope_keys if k is not None}) or ["default"]:
        layer_type = None if key == "default" else key
        inv_freq, scaling = rope_inv_freq(cfg, args.head_dim, layer_type)
        out[key] = RopeFrequencies(inv_freq, scaling)
        params = _rope_params(cfg, layer_type)
        if params.get("rope_type") == "longrope":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            # transformers switches a whole sequence to the long factors once it passes the original
            # context; a paged cache keeps K as written, so here positions past it use them (vLLM's choice)
            orig = int(params["original_max_position_embeddings"])
            long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=orig + 1, layer_type=layer_type)
            out[key].long_inv_freq, out[key].long_from = long.float(), orig
    return out


def _rope_params(cfg, layer_type: str | None) -> dict:
    params = getattr(cfg, "rope_parameters", None) or {}
    return params[layer_type] if layer_type is not None else params


def rope_inv_freq(hf_config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim / 2] and attention scaling for any rope type transformers knows (of
    one layer type's parameters where the config gives them per layer type, Gemma 3)."""
    cfg = text_config(hf_config)
    params = _rope_params(cfg, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = rotary_dim(cfg, head_dim)
        theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float(), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}: expected one of default, "
                         f"{', '.join(ROPE_INIT_FUNCTIONS)}")
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", **kwargs)
    return inv_freq.float(), float(scaling)
