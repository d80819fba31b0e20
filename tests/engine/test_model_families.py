"""The model families the loader takes besides Llama, each against HF transformers on the same random
weights: Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm, head_dim apart from hidden / heads), Mistral
(a sliding window per layer, not a cap on the context). Every weight is random, norms and biases included, so a weight
loaded into the wrong place (or in the wrong rope layout) changes the tokens."""

import os

import pytest
import torch

from agentrt.engine import LLM, SamplingParams
from agentrt.engine.loader import load_tokenizer, resolve_model
from tests.conftest import assert_all_blocks_free

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SMALL = {"vocab_size": 49152, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6}


def _save(tmp_path, cfg):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:  # biases
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    load_tokenizer(resolve_model(os.environ.get("AGENTRT_TEST_TOKENIZER"))).save_pretrained(tmp_path)
    return hf


def _prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(**SMALL, tie_word_embeddings=False, rope_theta=1e6)


def qwen3_config():
    from transformers import Qwen3Config

    # head_dim 64 with 4 heads over hidden 128: q is 256 wide, o_proj maps it back to 128
    return Qwen3Config(**SMALL, head_dim=64, tie_word_embeddings=True, rope_theta=1e6)


@pytest.mark.parametrize("steps", [1, 4], ids=["step", "multi-step"])
@pytest.mark.parametrize("make_config", [qwen2_config, qwen3_config], ids=["qwen2", "qwen3"])
def test_family_matches_hf(tmp_path, make_config, steps, monkeypatch):
    """Chunked prefill (16-token budget chunks of a 60-token prompt), several sequences batched, and
    decode past block boundaries: greedy tokens identical to HF's. With the C++ kernels, decode runs in
    their fused one-call step (`decode_forward`; `decode_steps` with several scheduler steps)."""
    from agentrt.kernels import cpu as kernels_cpu

    hf = _save(tmp_path, make_config())
    fused = []
    if (ops := kernels_cpu.ops()) is not None:
        for name in ("decode_forward", "decode_steps"):
            real = getattr(ops, name)
            monkeypatch.setattr(ops, name, lambda *a, _r=real, _n=name: fused.append(_n) or _r(*a), raising=False)
    llm = LLM(str(tmp_path), num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
              num_scheduler_steps=steps)
    prompts = _prompts([5, 23, 60])
    with torch.no_grad():
        want = [_hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == want
    if ops is not None:
        assert ("decode_steps" if steps > 1 else "decode_forward") in fused
    assert_all_blocks_free(llm.core)


def test_qwen3_without_cpu_kernels_and_prompt_logprobs(tmp_path):
    """The torch path (no C++ kernels) gives Qwen3 the same tokens, and each prompt token's log-prob is
    HF's log-softmax: the norm reaches every position, not only the decode rows."""
    from agentrt.kernels import cpu as kernels_cpu

    hf = _save(tmp_path, qwen3_config())
    prompt = _prompts([30], seed=11)[0]
    with torch.no_grad():
        want = _hf_greedy(hf, prompt, GREEDY.max_tokens)
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), dim=-1)
    with kernels_cpu.use_cpu_kernels(False):
        llm = LLM(str(tmp_path), num_blocks=32, block_size=4)
        out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, prompt_logprobs=0))[0]
    assert out.token_ids == want
    got = out.prompt_logprobs[1:]
    expect = [float(ref[i, tok]) for i, tok in enumerate(prompt[1:])]
    assert got == pytest.approx(expect, abs=2e-4)
    assert_all_blocks_free(llm.core)


def test_sliding_window_does_not_cap_the_context(tmp_path):
    """A Mistral whose layers attend to the last 64 positions is served at its whole context (its layers
    take the window; tests/engine/test_dense_architectures.py holds them to HF past it)."""
    from transformers import MistralConfig

    _save(tmp_path, MistralConfig(**SMALL, sliding_window=64))
    llm = LLM(str(tmp_path), num_blocks=64, block_size=4)
    assert llm.core.max_model_len == 1024
    assert llm.core.model.args.windows == (64, 64)
    out = llm.generate([_prompts([80])[0]], GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_tokens
    assert_all_blocks_free(llm.core)


def test_unsupported_family_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'gpt2'.*llama, mistral, .*qwen2, qwen3, .*gemma3_text"):
        LLM(str(tmp_path))


def test_qwen3_bf16_error_within_twice_hf_bf16(tmp_path):
    """In bf16 the engine's prompt log-probs stray from HF's fp32 ones by at most twice as much as HF's own
    bf16 model does (the kernel rule, here over a whole model with its q/k norms)."""
    hf = _save(tmp_path, qwen3_config())
    prompt = _prompts([40], seed=5)[0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0].double(), dim=-1)
        hf16 = torch.log_softmax(hf.to(torch.bfloat16)(ids).logits[0].double(), dim=-1)
    rows = torch.arange(len(prompt) - 1)
    nxt = torch.tensor(prompt[1:])
    want, theirs = ref[rows, nxt], hf16[rows, nxt]
    llm = LLM(str(tmp_path), dtype="bfloat16", num_blocks=32, block_size=4)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    ours = torch.tensor(out.prompt_logprobs[1:], dtype=torch.float64)
    hf_err = float((theirs - want).abs().mean())
    assert 0 < hf_err  # bf16 really rounds
    assert float((ours - want).abs().mean()) <= 2 * hf_err
    assert_all_blocks_free(llm.core)
