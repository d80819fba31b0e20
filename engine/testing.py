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
