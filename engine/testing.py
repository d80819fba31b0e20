"""Helpers for tests and benchmarks: tiny random models that load like real ones."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from agentrt.engine.loader import load_tokenizer, resolve_model


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
    "qwen3-4b": {  # issue 50's Q4_K_M shape (agentrt.bench.random_gguf); tied, unlike Qwen3-8B and up
        "model_type": "qwen3",
        "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "qwen3-30b-a3b": {  # 128 experts of 768, top 8 (renormalized); q/k norms
        "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "max_position_embeddings": 40960, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "gpt-oss-20b": {  # 32 experts of 2880, top 4, biased router; 128-token windows alternating with full layers, sinks
        "model_type": "gpt_oss",
        "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
        "num_experts_per_tok": 4, "sliding_window": 128, "max_position_embeddings": 131072, "attention_bias": True,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "swiglu_limit": 7.0,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
    },
}


def make_random_model(path: str | Path, preset: str, *, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                      seed: int = 0, tokenizer_from: str | None = None, num_layers: int | None = None,
                      mxfp4_experts: bool = False):
    """Write a random-weight model of a real model's shape and family (`PRESETS`) to `path`, with the default
    model's tokenizer; return `(path, hf_model)`, the HF model already on `device` in `dtype`, so a
    benchmark can compare against it without loading the weights twice. `num_layers` cuts the model to its
    first layers (a mixture of experts' shape on a machine without room for all of them). `mxfp4_experts`
    (gpt-oss): the experts written in MXFP4 as the real checkpoint ships them, HF's copy holding the values
    they stand for (`save_mxfp4_experts`).

    Weights are HF's own init (normal, std = initializer_range), built directly on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; expected one of {', '.join(PRESETS)}")
    path = Path(path)
    tok = load_tokenizer(resolve_model(tokenizer_from))
    fields = dict(PRESETS[preset])
    if num_layers is not None:
        if not 1 <= num_layers <= fields["num_hidden_layers"]:
            raise ValueError(f"num_layers {num_layers} is not between 1 and {preset}'s {fields['num_hidden_layers']}")
        fields["num_hidden_layers"] = num_layers
    if mxfp4_experts and fields["model_type"] != "gpt_oss":
        raise ValueError(f"mxfp4_experts: {preset} is a {fields['model_type']} model; MXFP4 experts are gpt-oss's")
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    if mxfp4_experts:
        save_mxfp4_experts(model, path)
    else:
        model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model


MXFP4_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")  # gpt-oss's weights shipped in MXFP4


@torch.no_grad()
def save_mxfp4_experts(hf, path: str | Path) -> Path:
    """Write HF gpt-oss model `hf` to `path` as the real checkpoint ships: each expert stack (`MXFP4_EXPERTS`,
    held [E, in, out]) as MXFP4 `*_blocks` / `*_scales` of [E, out, in] (`quantize_mxfp4`), the config's
    `quantization_config` saying so; `hf`'s own experts are set to the values the blocks stand for, so HF and
    an engine reading the file run equal weights. One expert at a time (no fp32 copy of a stack)."""
    from safetensors.torch import save_file

    from agentrt.engine.moe import dequantize_mxfp4

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd: dict[str, torch.Tensor] = {}
    tied = getattr(hf.config, "tie_word_embeddings", False)
    for name, t in hf.state_dict().items():
        if tied and name == "lm_head.weight":  # the embedding's storage (safetensors keeps one name of a tensor)
            continue
        if not name.endswith(MXFP4_EXPERTS):
            sd[name] = t.detach().cpu().contiguous()
            continue
        blocks, scales = [], []
        for e in range(t.shape[0]):
            b, sc = quantize_mxfp4(t[e].transpose(0, 1))
            t[e].copy_(dequantize_mxfp4(b, sc).transpose(0, 1))
            blocks.append(b)
            scales.append(sc)
        sd[name + "_blocks"], sd[name + "_scales"] = torch.stack(blocks), torch.stack(scales)
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf.config.save_pretrained(path)
    if getattr(hf, "generation_config", None) is not None:
        hf.generation_config.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> MXFP4 (blocks [..., K / 32, 16] uint8, scales [..., K / 32] uint8), the
    layout of gpt-oss's `*_blocks` / `*_scales` tensors: per group of 32 values a power of two (biased by 127)
    that brings the group's largest magnitude to at most 6, each value the nearest 4-bit E2M1 code (sign bit
    3), two codes a byte, the first in the low nibble. `engine.moe.dequantize_mxfp4` inverts it (exactly, for
    values already on the grid)."""
    from agentrt.engine.moe import _FP4_E2M1

    if w.shape[-1] % 32:
        raise ValueError(f"MXFP4 groups 32 values: the last dim {w.shape[-1]} is not a multiple of 32")
    lead, groups = w.shape[:-1], w.shape[-1] // 32
    flat = w.detach().reshape(-1, 32)
    blocks = torch.empty(flat.shape[0], 16, dtype=torch.uint8)
    scales = torch.empty(flat.shape[0], dtype=torch.uint8)
    grid = torch.tensor(_FP4_E2M1[:8])  # magnitudes; codes 8-15 the same with the sign bit
    for r in range(0, flat.shape[0], 1 << 16):  # groups at a time: no [..., 8]-wide copy of a large weight
        g = flat[r : r + (1 << 16)].float().cpu()
        amax = g.abs().amax(-1, keepdim=True).clamp(min=2.0**-126)
        exp = (torch.ceil(torch.log2(amax / 6.0))).clamp(-127, 127)  # 6 * 2^exp >= amax
        scaled = g / torch.exp2(exp)
        code = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(-1) + 8 * (scaled < 0).long()
        pairs = code.view(-1, 16, 2)
        blocks[r : r + (1 << 16)] = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
        scales[r : r + (1 << 16)] = (exp.squeeze(-1) + 127).to(torch.uint8)
    return blocks.view(*lead, groups, 16), scales.view(*lead, groups)


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapter(path: str | Path, hf_config, *, rank: int = 8, alpha: float = 16.0,
                      targets: tuple[str, ...] = LORA_MODULES, seed: int = 0, std: float = 0.1,
                      use_rslora: bool = False) -> Path:
    """Write a random PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors, PEFT's key names)
    for a model of `hf_config` (its HF config object) to `path`; return it. Unlike PEFT's init, B is
    random too, so the adapter changes the model's outputs."""
    from safetensors.torch import save_file

    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    dims = {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
            "o_proj": (q, c.hidden_size), "gate_proj": (c.hidden_size, c.intermediate_size),
            "up_proj": (c.hidden_size, c.intermediate_size), "down_proj": (c.intermediate_size, c.hidden_size)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_hidden_layers):
        for mod in targets:
            fan_in, fan_out = dims[mod]
            block = "self_attn" if mod in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{mod}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * std
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
              "bias": "none", "use_rslora": use_rslora, "task_type": "CAUSAL_LM", "lora_dropout": 0.0}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


def merge_lora(hf_model, adapter_path: str | Path):
    """`hf_model` with the adapter's pairs merged into its weights (W + alpha / r * B @ A), in place; the
    reference an engine serving the adapter unmerged is compared with."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(adapter_path) / "adapter_config.json").read_text())
    sd = load_file(str(Path(adapter_path) / "adapter_model.safetensors"))
    params = dict(hf_model.named_parameters())
    with torch.no_grad():
        for key, a in sd.items():
            if ".lora_A." not in key:
                continue
            b = sd[key.replace(".lora_A.", ".lora_B.")]
            r = a.shape[0]
            scale = cfg["lora_alpha"] / (r**0.5 if cfg.get("use_rslora") else r)
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            w = params[name]
            w += (scale * b.float() @ a.float()).to(w.dtype)
    return hf_model
