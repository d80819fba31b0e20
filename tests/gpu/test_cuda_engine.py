"""The engine on a CUDA device: the Triton path gives HF's greedy tokens and the torch path's, every
KV block is free afterwards (batching, chunked prefill, preemption, forks with copy-on-write)."""

import pytest
import torch

from agentrt import kernels
from agentrt.engine import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def hf_fp32(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()


def hf_greedy(hf, prompt_ids, max_new):
    ids = torch.tensor([prompt_ids], device=hf.device)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new,
                      do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def test_fp32_on_gpu_matches_hf_on_cpu(tiny_model_path, hf_fp32):
    llm = LLM(str(tiny_model_path), device="cuda", dtype="float32", num_blocks=64, block_size=16,
              max_num_batched_tokens=64, max_num_seqs=8)
    prompts = prompts_of([5, 17, 64, 3, 90, 33])  # 90 > token budget: chunked prefill
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(hf_fp32, p, 12)
    assert llm.core.runner.kv_cache.is_cuda
    assert_all_blocks_free(llm.core)


def test_triton_and_torch_paths_agree_on_gpu(tiny_model_path):
    llm = LLM(str(tiny_model_path), device="cuda", dtype="float32", num_blocks=48, block_size=16,
              max_num_batched_tokens=48)
    prompts = prompts_of([7, 40, 3, 120], seed=1)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with kernels.use_backend("torch"):
        ref = llm.generate(prompts, params)
    tri = llm.generate(prompts, params)  # auto: Triton on CUDA tensors
    forked = llm.generate(prompts[1], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, n=3))
    assert [o.token_ids for o in tri] == [o.token_ids for o in ref]
    assert [o.token_ids for o in forked[0].outputs] == [ref[1].token_ids[:5]] * 3
    assert llm.kv_stats().cow_copies > 0  # copy_blocks ran on the GPU
    assert_all_blocks_free(llm.core)


def test_preemption_on_gpu_keeps_greedy_outputs(tiny_model_path, hf_fp32):
    small = LLM(str(tiny_model_path), device="cuda", dtype="float32", num_blocks=14, block_size=4, max_num_seqs=8,
                max_num_batched_tokens=64)
    prompts = prompts_of([9, 13, 11, 10], seed=2)
    outs = small.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert small.kv_stats().num_preemptions > 0
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(hf_fp32, p, 10)
    assert_all_blocks_free(small.core)


def test_bf16_default_on_gpu(tiny_model_path):
    """The GPU defaults (device, bf16): first greedy tokens are HF's in bf16 on the GPU, seeded sampling is
    reproducible, all blocks come back."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_model_path), max_num_seqs=16, kv_cache_bytes=2**30)
    assert llm.core.config.device == "cuda" and llm.core.config.torch_dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.bfloat16).to("cuda").eval()
    prompts = prompts_of([12, 50, 200, 7], seed=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    firsts = sum(o.token_ids[0] == hf_greedy(hf, p, 1)[0] for p, o in zip(prompts, outs, strict=True))
    assert firsts >= 3, f"only {firsts}/4 first tokens match HF in bf16"
    sampled = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=5))
    again = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=5))
    assert [o.token_ids for o in sampled] == [o.token_ids for o in again]
    assert_all_blocks_free(llm.core)
