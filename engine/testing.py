"""Helpers for tests and benchmarks: tiny random models that load like real ones."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.loader import load_tokenizer, resolve_model


def make_tiny_model(
    path: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position: int = 2048,
    seed: int = 0,
    tokenizer_from: str | None = None,
) -> Path:
    """Write a random Llama with the default model's tokenizer (and vocab) to `path`; return it.

    Weights are HF `LlamaForCausalLM`'s own init, so HF and the engine can be compared on them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    tok = load_tokenizer(resolve_model(tokenizer_from))
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position, tie_word_embeddings=True, rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger than HF's init so logits are not flat and greedy is meaningful
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# Real model shapes, for benchmarks on random weights (a GPU machine without the checkpoints); each an
# HF config's fields, its family in "model_type".
PRESETS: dict[str, dict] = {
    "smollm2-135m": {
        "model_type": "llama",
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    },
    "llama-3.1-8b": {
        "model_type": "llama",
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
    "qwen3-0.6b": {  # per-head q/k norms; q is 2048 wide over a hidden size of 1024
        "model_type": "qwen3",
        "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
}


def make_random_model(path: str | Path, preset: str, *, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                      seed: int = 0, tokenizer_from: str | None = None):
    """Write a random-weight model of a real model's shape and family (`PRESETS`) to `path`, with the default
    model's tokenizer; return `(path, hf_model)`, the HF model already on `device` in `dtype`, so a
    benchmark can compare against it without loading the weights twice.

    Weights are HF's own init (normal, std = initializer_range), built directly on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; expected one of {', '.join(PRESETS)}")
    path = Path(path)
    tok = load_tokenizer(resolve_model(tokenizer_from))
    fields = dict(PRESETS[preset])
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model
