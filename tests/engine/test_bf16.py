"""The engine in bf16 on CPU: `dtype="auto"`, and greedy parity with HF transformers in bf16.

Parity rule. bf16 models are not bitwise reproducible across implementations (GEMM summation
order differs), so where two candidate tokens are within bf16's error of each other both greedy
choices are right. The engine's and HF's bf16 greedy tokens must be identical up to their first
difference, and that difference must fall on a near-tie: there the fp32 model's logits of the two
chosen tokens differ by at most twice HF bf16's own error at that position (max |logit_bf16 -
logit_fp32| over the vocabulary; the kernel tests' factor of two). Where fp32 has a clear winner,
both bf16 implementations pick the same token.
"""

import pytest
import torch

from agentrt.engine import LLM, EngineConfig, SamplingParams
from agentrt.engine.config import auto_dtype
from agentrt.kernels import cpu
from tests.conftest import assert_all_blocks_free, requires_default_model

needs_cpp = pytest.mark.skipif(not cpu.available(), reason="C++ CPU kernels cannot be built here")


# ------------------------------------------------------------------------------------------- dtype auto


@pytest.fixture
def no_env_dtype(monkeypatch):
    monkeypatch.delenv("AGENTRT_DTYPE", raising=False)
    monkeypatch.delenv("AGENTRT_DEVICE", raising=False)


@pytest.mark.parametrize(("flags", "dtype"), [
    ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
    ({"avx2", "amx_bf16"}, "bfloat16"),
    ({"avx2", "fma", "avx512f"}, "float32"),
    (set(), "float32"),
])
def test_auto_dtype_follows_cpu_flags(no_env_dtype, monkeypatch, flags, dtype):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    cfg = EngineConfig(device="cpu")
    assert cfg.dtype == dtype and cfg.dtype_reason.startswith("auto: ")
    assert ("no native bf16" in cfg.dtype_reason) == (dtype == "float32")
    assert EngineConfig(device="cpu", dtype="auto").dtype == dtype


def test_auto_dtype_on_this_machine(no_env_dtype):
    cfg = EngineConfig(device="cpu")
    assert cfg.dtype == ("bfloat16" if cpu.has_native_bf16() else "float32")
    assert (cfg.dtype, cfg.dtype_reason) == (auto_dtype("cpu")[0], "auto: " + auto_dtype("cpu")[1])


def test_explicit_dtype_wins_and_env_var_works(no_env_dtype, monkeypatch):
    monkeypatch.setenv("AGENTRT_DTYPE", "bfloat16")
    assert EngineConfig(device="cpu").dtype == "bfloat16"
    assert EngineConfig(device="cpu").dtype_reason == "set by $AGENTRT_DTYPE"
    assert EngineConfig(device="cpu", dtype="float32").dtype == "float32"
    monkeypatch.setenv("AGENTRT_DTYPE", "auto")
    assert EngineConfig(device="cpu").dtype == auto_dtype("cpu")[0]
    monkeypatch.setenv("AGENTRT_DTYPE", "fp8")
    with pytest.raises(ValueError, match=r"'fp8' \(\$AGENTRT_DTYPE\)"):
        EngineConfig(device="cpu")


def test_startup_line_names_dtype_and_kernels(tiny_model_path, caplog):
    with caplog.at_level("INFO", logger="agentrt.engine"):
        llm = LLM(str(tiny_model_path), dtype="bfloat16", num_blocks=8)
    line = llm.core.startup_line
    assert "bfloat16 (set by dtype)" in line and "on cpu" in line and "kernels: " in line
    assert line in caplog.text


# ------------------------------------------------------------------------------------------------ parity


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def check_bf16_parity(prompt: list[int], got: list[int], want_bf16: list[int], hf32, hf16) -> int:
    """The module docstring's rule; returns how many tokens are identical."""
    i = next((j for j, (a, b) in enumerate(zip(got, want_bf16)) if a != b), None)
    if i is None:
        assert len(got) == len(want_bf16)
        return len(got)
    ids = torch.tensor([prompt + got[:i]])
    l32 = hf32(ids).logits[0, -1].double()
    l16 = hf16(ids).logits[0, -1].double()
    bf16_error = (l16 - l32).abs().max().item()
    gap = (l32[got[i]] - l32[want_bf16[i]]).abs().item()
    assert gap <= 2 * bf16_error, (f"token {i}: engine {got[i]}, HF bf16 {want_bf16[i]}: fp32 logits differ by "
                                   f"{gap:.3f}, more than twice HF bf16's error {bf16_error:.3f}")
    return i


@pytest.fixture(scope="module")
def head64_model(tmp_path_factory):
    """A 2-layer random Llama with head_dim 64 (the C++ attention's), the real tokenizer."""
    import os

    from agentrt.engine.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-64"), hidden_size=128, num_heads=2, num_kv_heads=1,
                           tokenizer_from=os.environ.get("AGENTRT_TEST_TOKENIZER"))


@pytest.fixture(scope="module")
def head64_hf(head64_model):
    from transformers import AutoModelForCausalLM

    return tuple(AutoModelForCausalLM.from_pretrained(str(head64_model), dtype=d).eval()
                 for d in (torch.float32, torch.bfloat16))


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]


KINDS = ["avx512_bf16", "avx512", "avx2"]


@needs_cpp
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_engine_matches_hf_bf16_on_each_cpu_kind(head64_model, head64_hf, kind):
    """Prefill chunks, decode from the bf16 cache, fused norms and RoPE, on each CPU kind this machine runs."""
    if kind not in cpu.supported_kinds():
        pytest.skip(f"this CPU does not support the {kind} kernels")
    hf32, hf16 = head64_hf
    prompts = prompts_of([5, 40, 130, 17])
    with cpu.use_kind(kind):
        llm = LLM(str(head64_model), dtype="bfloat16", num_blocks=64, block_size=16, max_num_batched_tokens=64)
        assert llm.core.model.embed_tokens.weight.dtype == torch.bfloat16
        assert llm.core.runner.kv_cache.dtype == torch.bfloat16
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    same = [check_bf16_parity(p, list(o.token_ids), hf_greedy(hf16, p, 12), hf32, hf16) for p, o in zip(prompts, outs)]
    assert sum(same) >= 24, same  # most tokens identical, not only near-ties
    assert_all_blocks_free(llm.core)


@needs_cpp
@pytest.mark.parametrize("kind", KINDS)
def test_fp32_engine_matches_hf_fp32_on_each_cpu_kind(head64_model, head64_hf, kind):
    if kind not in cpu.supported_kinds():
        pytest.skip(f"this CPU does not support the {kind} kernels")
    hf32, _ = head64_hf
    prompts = prompts_of([9, 70], seed=1)
    with cpu.use_kind(kind):
        llm = LLM(str(head64_model), dtype="float32", num_blocks=32, block_size=16)
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == hf_greedy(hf32, p, 10)


@pytest.fixture
def threads(request):
    """torch's intra-op threads for one test (decode_forward runs them as one team: kernels/csrc/team.h)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@needs_cpp
@pytest.mark.parametrize("threads", [1, 2, 3], indirect=True)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_step_in_one_call_matches_layer_by_layer(head64_model, dtype, threads, monkeypatch):
    """`decode_forward` (all layers of a decode step in one C++ call, its threads one team) computes exactly
    what the modules do with the same threads: one, two, and more than this machine may have cores."""
    from agentrt import kernels
    prompts = prompts_of([5, 40, 17], seed=4)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
    llm = LLM(str(head64_model), dtype=dtype, num_blocks=32, block_size=16, enable_prefix_caching=False)
    ops, calls = kernels.cpu.ops(), []
    real = ops.decode_forward
    monkeypatch.setattr(ops, "decode_forward", lambda *a: (calls.append(1), real(*a))[1])
    fused = llm.generate(prompts, params)
    assert len(calls) == 7  # every step after the prefill
    monkeypatch.setattr(llm.core.model, "_decode_fusable", lambda *a: False)
    modular = llm.generate(prompts, params)
    assert len(calls) == 7
    for a, b in zip(fused, modular, strict=True):
        assert a.token_ids == b.token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs


def test_bf16_engine_without_cpp_kernels(head64_model, head64_hf):
    """The torch fallback in bf16 (no compiler): same rule."""
    hf32, hf16 = head64_hf
    prompts = prompts_of([33, 8], seed=2)
    with cpu.use_cpu_kernels(False):
        llm = LLM(str(head64_model), dtype="bfloat16", num_blocks=32, block_size=16)
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        check_bf16_parity(p, list(o.token_ids), hf_greedy(hf16, p, 8), hf32, hf16)


# -------------------------------------------------------------------------------------------- real model

TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring "
    "circuits; later, stored programs let instructions live in memory beside data. Compilers turned "
    "human-readable languages into machine code, and operating systems shared one processor among many "
    "programs by scheduling them in turn. "
)
TARGET_LENGTHS = [5, 23, 64, 131, 250, 377, 480, 600]
MAX_NEW = 16


@requires_default_model
@pytest.mark.slow
def test_real_model_bf16_matches_hf_bf16(default_model_path):
    """SmolLM2-135M-Instruct in bf16: the engine (all prompts in one batch, continuous batching) against
    HF's bf16 `generate`, one prompt at a time, under the parity rule."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(default_model_path), dtype="bfloat16")
    ids = llm.tokenizer(TEXT * 14)["input_ids"]
    prompts = [ids[11 * i: 11 * i + n] for i, n in enumerate(TARGET_LENGTHS)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    hf32, hf16 = (AutoModelForCausalLM.from_pretrained(str(default_model_path), dtype=d).eval()
                  for d in (torch.float32, torch.bfloat16))
    same = [check_bf16_parity(p, list(o.token_ids), hf_greedy(hf16, p, MAX_NEW), hf32, hf16)
            for p, o in zip(prompts, outs)]
    assert sum(s == MAX_NEW for s in same) >= len(prompts) // 2, same
    assert_all_blocks_free(llm.core)
