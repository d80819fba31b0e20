"""Every Triton kernel compiled for the GPU against its torch reference (run on CPU) and dense attention.

Same tolerance rule as tests/kernels (flash-attention's): err(kernel) <= 2 * err(torch, same dtype) + atol,
errors measured against fp32 dense attention.
"""

import pytest
import torch

from agentrt.kernels import (
    copy_blocks_ref,
    copy_blocks_triton,
    paged_attention_triton,
    rms_norm_ref,
    rms_norm_triton,
    silu_and_mul_ref,
    silu_and_mul_triton,
    store_kv_ref,
    store_kv_triton,
)
from agentrt.kernels.paged_attention import _auto_num_splits
from tests.paged_batch import check_rule, make_paged_batch, to_device

CUDA = torch.device("cuda")
SCENARIOS = {
    "mixed": ([1, 5, 1, 20], [33, 17, 70, 40]),
    "prefill": ([37, 23], [37, 61]),
    "decode": ([1, 1, 1], [1, 45, 64]),
    "decode_spread": ([1, 1, 1, 1, 1, 2], [3, 300, 40, 620, 290, 45]),
    "long_prefill": ([300, 1], [700, 1000]),
}
GQA = [(4, 4), (9, 3), (8, 1), (32, 8)]  # ratios 1, 3, 8, 4 (Llama-3.1-8B)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_paged_attention(scenario, heads, dtype):
    batch = make_paged_batch(*SCENARIOS[scenario], *heads, 64, 16, dtype)
    gpu = to_device(batch, CUDA)
    out = paged_attention_triton(gpu.q, gpu.k_cache, gpu.v_cache, gpu.meta, 0.125, num_splits=1)
    check_rule(out, batch, 0.125)


@pytest.mark.parametrize(("head_dim", "block_size", "dtype"), [
    (128, 16, torch.bfloat16), (128, 32, torch.float16), (64, 32, torch.bfloat16), (128, 32, torch.float32),
    (96, 16, torch.bfloat16),  # not a power of two: padded to 128
])
@pytest.mark.parametrize("scenario", ["mixed", "decode_spread"])
def test_paged_attention_head_dims_and_block_sizes(scenario, head_dim, block_size, dtype):
    batch = make_paged_batch(*SCENARIOS[scenario], 32, 8, head_dim, block_size, dtype, seed=1)
    gpu = to_device(batch, CUDA)
    scale = head_dim ** -0.5
    check_rule(paged_attention_triton(gpu.q, gpu.k_cache, gpu.v_cache, gpu.meta, scale), batch, scale)


@pytest.mark.parametrize("num_splits", [None, 2, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_decode(num_splits, dtype):
    batch = make_paged_batch([1, 1, 1, 1], [3000, 1500, 2049, 17], 32, 8, 128, 16, dtype, seed=2)
    gpu = to_device(batch, CUDA)
    if num_splits is None:
        assert _auto_num_splits(gpu.meta, 8, CUDA) > 1  # 4 sequences x 8 kv heads cannot fill the GPU
    scale = 128 ** -0.5
    out = paged_attention_triton(gpu.q, gpu.k_cache, gpu.v_cache, gpu.meta, scale, num_splits=num_splits)
    check_rule(out, batch, scale)


def test_cache_beyond_int32_offsets():
    """A cache of more than 2**31 elements: K/V in its last blocks are stored and read back correctly."""
    block_size, kvh, d = 16, 8, 128
    num_blocks = 2**31 // (block_size * kvh * d) + 64
    free, _ = torch.cuda.mem_get_info()
    if 2 * num_blocks * block_size * kvh * d * 2 > 0.5 * free:
        pytest.skip("not enough GPU memory for a 2 x 4 GiB cache")
    k_cache = torch.zeros(num_blocks, block_size, kvh, d, dtype=torch.bfloat16, device=CUDA)
    v_cache = torch.zeros_like(k_cache)
    seq_len = 3 * block_size + 5
    blocks = torch.tensor([num_blocks - 1, num_blocks - 40, num_blocks - 2, num_blocks - 7], dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(seq_len, kvh, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(seq_len, kvh, d, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([int(blocks[p // block_size]) * block_size + p % block_size for p in range(seq_len)])
    store_kv_triton(k.to(CUDA), v.to(CUDA), k_cache, v_cache, slots.to(CUDA))
    assert torch.equal(k_cache.view(-1, kvh, d)[slots.to(CUDA)].cpu(), k)
    from agentrt.kernels import build_attention_metadata

    q = torch.randn(seq_len, 32, d, generator=gen).to(torch.bfloat16)
    meta = build_attention_metadata(torch.tensor([0, seq_len], device=CUDA), torch.tensor([seq_len], device=CUDA),
                                    blocks.view(1, -1).to(CUDA), seq_len, seq_len)
    out = paged_attention_triton(q.to(CUDA), k_cache, v_cache, meta, d ** -0.5).cpu().float()
    from agentrt.kernels import dense_causal_attention_ref

    gold = dense_causal_attention_ref(q.float(), k.float(), v.float(), d ** -0.5)
    assert (out - gold).abs().max().item() < 3e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(3, 64, 16), (8, 128, 32)])
def test_store_kv(num_kv_heads, head_dim, block_size, dtype):
    torch.manual_seed(0)
    num_tokens, num_blocks = 100, 12
    qkv = torch.randn(num_tokens, (32 + 2 * num_kv_heads) * head_dim).to(dtype)
    _, k, v = qkv.split([32 * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    k, v = k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::7] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    ref_k, ref_v = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    store_kv_ref(k, v, ref_k, ref_v, slots)
    gpu_k, gpu_v = ref_k.new_full(shape, float("nan")).to(CUDA), ref_v.new_full(shape, float("nan")).to(CUDA)
    store_kv_triton(k.to(CUDA), v.to(CUDA), gpu_k, gpu_v, slots.to(CUDA))  # strided views of the fused output
    torch.testing.assert_close(gpu_k.cpu(), ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(gpu_v.cpu(), ref_v, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks(dtype):
    torch.manual_seed(0)
    kv_cache = torch.randn(3, 2, 10, 16, 3, 64).to(dtype)
    mapping = torch.tensor([[1, 4], [2, 7], [9, 0]])
    want = kv_cache.clone()
    copy_blocks_ref(want, mapping)
    got = kv_cache.to(CUDA)
    copy_blocks_triton(got, mapping.to(CUDA))
    assert torch.equal(got.cpu(), want)


ELEMENTWISE_ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(33, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    residual = torch.randn(33, hidden, generator=gen).to(dtype) if with_residual else None
    out = rms_norm_triton(x.to(CUDA), weight.to(CUDA), 1e-5, residual.to(CUDA) if with_residual else None)
    same = rms_norm_ref(x, weight, 1e-5, residual)
    gold = rms_norm_ref(x.float(), weight.float(), 1e-5, residual.float() if with_residual else None)
    if with_residual:
        torch.testing.assert_close(out[1].cpu(), same[1], rtol=0, atol=0)  # the same rounded sum
        out, same, gold = out[0], same[0], gold[0]
    err = (out.cpu().float() - gold.float()).abs().max().item()
    err_torch = (same.float() - gold.float()).abs().max().item()
    assert err <= 2 * err_torch + ELEMENTWISE_ATOL[dtype], f"err {err:.3g} vs torch {err_torch:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [1536, 14336])
def test_silu_and_mul(dtype, inter):
    x = torch.randn(17, 2 * inter, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = silu_and_mul_triton(x.to(CUDA)).cpu()
    err = (out.float() - silu_and_mul_ref(x.float())).abs().max().item()
    err_torch = (silu_and_mul_ref(x).float() - silu_and_mul_ref(x.float())).abs().max().item()
    assert err <= 2 * err_torch + ELEMENTWISE_ATOL[dtype], f"err {err:.3g} vs torch {err_torch:.3g}"
