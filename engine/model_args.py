"""What a checkpoint's HF config says about the network `engine.model` builds: its shapes and layout
(`ModelArgs`), its rotary frequencies (any rope type transformers knows), and the context it can be
served at (a sliding window caps it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    moe: MoEArgs | None = None  # the mixture of experts of Mixtral, Qwen-MoE, gpt-oss (engine.moe); None = dense

    @classmethod
    def from_hf(cls, cfg) -> ModelArgs:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position=min(cfg.max_position_embeddings, sliding_window(cfg) or cfg.max_position_embeddings),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
                     or bool(getattr(cfg, "qkv_bias", False)),  # Qwen2-MoE's name
            qk_norm=cfg.model_type in ("qwen3", "qwen3_moe"),
            num_labels=cfg.num_labels if any(a.endswith("ForSequenceClassification")
                                             for a in getattr(cfg, "architectures", None) or ()) else 0,
            moe=MoEArgs.from_hf(cfg),
        )


def sliding_window(cfg) -> int | None:
    """The attention window of a checkpoint whose layers (some or all) attend to only the last W
    positions, else None. The engine attends to every position, so it serves such a model up to W
    positions, where the two agree (its context is capped there, as vLLM does without a sliding-window
    kernel)."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    if cfg.model_type in ("qwen2", "qwen3") and not getattr(cfg, "use_sliding_window", False):
        return None
    return int(window)


def rope_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for any rope type transformers knows."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).float(), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq.float(), float(scaling)
