"""The dense architectures past Llama, each a tiny checkpoint made from transformers' own config class
(seeded random weights, 3 layers, windows of 8-12 tokens) against transformers' eager model in fp32:
logits at every prefill position (chunked, over cached context) and every decode position within NMSE
1e-4, on the C++ kernels, the torch path and the Triton kernels (interpreted); greedy decoding through
the engine equal to HF's; bf16 by the top-5 rule (llama.cpp's test-llama-archs, vLLM's
check_logprobs_close). Prompts are longer than the windows, so a layer that ignored its window, its
rotary table, its norms or its soft-cap would fail."""

import os

import pytest
import torch

from agentrt import kernels
from agentrt.engine import LLM, SamplingParams
from agentrt.engine.loader import load_model, load_tokenizer, resolve_model
from agentrt.kernels import build_attention_metadata, cpu
from tests.conftest import assert_all_blocks_free

VOCAB = 512
BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
SLIDING3 = ["sliding_attention", "full_attention", "sliding_attention"]


def _config(arch: str):
    import transformers as tf

    if arch == "gemma2":  # soft-capped scores and logits, query_pre_attn_scalar, sandwich norms, GeLU-tanh
        return tf.Gemma2Config(**BASE, sliding_window=8, layer_types=SLIDING3, query_pre_attn_scalar=24,
                               attn_logit_softcapping=4.0, final_logit_softcapping=3.0)
    if arch == "gemma3_text":  # q/k norms, local (10k) and global (1M, linear x4) rotary tables
        return tf.Gemma3TextConfig(**BASE, sliding_window=12, layer_types=SLIDING3, query_pre_attn_scalar=32,
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                       "rope_theta": 1e6}})
    if arch == "phi3":  # fused qkv / gate_up weights, partial rotary, LongRoPE (short factors in range), window
        cfg = {**BASE, "hidden_size": 128}
        cfg.pop("head_dim")
        return tf.Phi3Config(**cfg, sliding_window=10, original_max_position_embeddings=64,
                             rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                              "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                              "long_factor": [2.0 + 0.3 * i for i in range(8)]})
    if arch == "smollm3":  # a NoPE layer in the middle
        return tf.SmolLM3Config(**BASE, no_rope_layers=[1, 0, 1])
    if arch == "ministral3":  # YaRN and the attention temperature past 16 positions
        return tf.Ministral3Config(**BASE, sliding_window=9, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1})
    if arch == "ministral":  # windows on alternate layers
        return tf.MinistralConfig(**BASE, sliding_window=8, layer_types=SLIDING3)
    if arch == "mistral":  # every layer windowed
        return tf.MistralConfig(**BASE, sliding_window=8)
    raise AssertionError(arch)


ARCHS = ["gemma2", "gemma3_text", "phi3", "smollm3", "ministral3", "ministral", "mistral"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (path, HF fp32 eager model) on seeded random weights (norms and biases random too)."""
    from transformers import AutoModelForCausalLM

    made = {}

    def make(arch):
        if arch not in made:
            path = tmp_path_factory.mktemp(arch)
            torch.manual_seed(0)
            hf = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32, attn_implementation="eager")
            with torch.no_grad():
                for name, p in hf.named_parameters():
                    if p.dim() == 2:
                        p.normal_(0, 0.15)
                    elif "norm" in name:
                        p.copy_((0.0 if arch.startswith("gemma") else 1.0) + 0.3 * torch.randn_like(p))
                    else:
                        p.normal_(0, 0.5)
            hf.eval().save_pretrained(path)
            load_tokenizer(resolve_model(os.environ.get("AGENTRT_TEST_TOKENIZER"))).save_pretrained(path)
            made[arch] = (path, hf)
        return made[arch]

    return make


def _tokens(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def engine_logits(model, tokens: list[int], prompt_len: int, chunk: int, block_size: int = 4) -> torch.Tensor:
    """Our model's logits [len(tokens), vocab] fp32 for one sequence: the prompt prefilled in chunks of
    `chunk` over the cached context, then one decode step per later token, over a shuffled block table."""
    a = model.args
    n_blocks = -(-len(tokens) // block_size)
    dtype = model.embed_tokens.weight.dtype
    kv = torch.zeros(a.num_layers, 2, n_blocks + 1, block_size, a.num_kv_heads, a.head_dim, dtype=dtype)
    table = (1 + torch.randperm(n_blocks, generator=torch.Generator().manual_seed(7))).int().view(1, -1)
    ids = torch.tensor(tokens)
    out, start = [], 0
    while start < len(tokens):
        end = min(start + chunk, prompt_len) if start < prompt_len else start + 1
        pos = torch.arange(start, end)
        slots = table[0, pos // block_size].long() * block_size + pos % block_size
        meta = build_attention_metadata(torch.tensor([0, end - start]), torch.tensor([end]), table, end - start, end)
        out.append(model.compute_logits(model.forward(ids[start:end], pos, kv, meta, slots)).float())
        start = end
    return torch.cat(out)


def _nmse(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((ours.double() - ref.double()) ** 2).sum() / (ref.double() ** 2).sum())


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


PATHS = {
    "cpp": lambda: cpu.use_cpu_kernels(True),
    "torch": lambda: cpu.use_cpu_kernels(False),
}


@pytest.mark.parametrize("path", ["cpp", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(checkpoints, arch, path):
    if path == "cpp" and not cpu.available():
        pytest.skip("C++ CPU kernels cannot be built here")
    ckpt, hf = checkpoints(arch)
    tokens = _tokens(40)
    ref = _hf_logits(hf, tokens)
    with PATHS[path](), kernels.use_backend("torch"):
        model, _ = load_model(ckpt, torch.float32, "cpu")
        ours = engine_logits(model, tokens, prompt_len=27, chunk=11)
    assert ours.shape == ref.shape
    assert _nmse(ours, ref) < 1e-4, f"{arch} {path}: NMSE {_nmse(ours, ref):.3g}"
    assert _nmse(ours[27:], ref[27:]) < 1e-4  # the decode rows alone (the C++ kernel's)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_triton(checkpoints, arch):
    ckpt, hf = checkpoints(arch)
    tokens = _tokens(22, seed=2)
    ref = _hf_logits(hf, tokens)
    with cpu.use_cpu_kernels(False), kernels.use_backend("triton"):
        model, _ = load_model(ckpt, torch.float32, "cpu")
        ours = engine_logits(model, tokens, prompt_len=17, chunk=9)
    assert _nmse(ours, ref) < 1e-4, f"{arch} triton: NMSE {_nmse(ours, ref):.3g}"


def _hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [s[0].float() for s in out.scores]


@pytest.mark.parametrize("arch", ["gemma3_text", "gemma2", "phi3"])
def test_engine_greedy_matches_transformers(checkpoints, arch):
    """Through the engine (scheduler, chunked prefill, batched decode past the windows): HF's greedy tokens."""
    ckpt, hf = checkpoints(arch)
    prompts = [_tokens(30, seed=3), _tokens(9, seed=4)]
    want = [_hf_greedy(hf, p, 12)[0] for p in prompts]
    llm = LLM(str(ckpt), num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    got = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                             SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    assert got == want
    assert llm.core.max_model_len == 256  # the model's own context, not its window
    assert_all_blocks_free(llm.core)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_top5_rule(checkpoints, arch):
    """bf16 engine vs bf16 transformers, 16 greedy tokens: equal, or at the first difference each side's
    token is in the other's top 5 (vLLM's check_logprobs_close)."""
    ckpt, hf = checkpoints(arch)
    prompt = _tokens(24, seed=5)
    hf16 = hf.to(torch.bfloat16)
    try:
        theirs, scores = _hf_greedy(hf16, prompt, 16)
    finally:
        hf.to(torch.float32)
    llm = LLM(str(ckpt), dtype="bfloat16", num_blocks=32, block_size=4)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                                      top_logprobs=5))[0].outputs[0]
    ours = list(out.token_ids)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            assert b in [t for t, _ in out.top_logprobs[i]], f"{arch}: HF's token {b} at step {i} not in our top 5"
            assert a in scores[i].topk(5).indices.tolist(), f"{arch}: our token {a} at step {i} not in HF's top 5"
            break
