"""store_kv and copy_blocks: Triton kernels (interpreted) against their torch references."""

import pytest
import torch

from agentrt.kernels import copy_blocks_ref, copy_blocks_triton, store_kv_ref, store_kv_triton


def fused_kv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """key, value as strided views of a fused qkv projection output [T, (H + 2 KVH) * D]."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    _, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    return k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(3, 64, 16), (8, 128, 32), (1, 64, 16)])
def test_store_kv_matches_ref(num_kv_heads, head_dim, block_size, dtype):
    torch.manual_seed(0)
    num_tokens, num_blocks = 13, 6
    key, value = fused_kv(num_tokens, 9, num_kv_heads, head_dim, dtype)
    assert not key.is_contiguous()
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 7, 12]] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(4)]
    store_kv_triton(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0, equal_nan=True)
    flat_k = caches[0].view(-1, num_kv_heads, head_dim)
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]], key[keep])
    assert flat_k.isnan().all(dim=(1, 2)).sum() == num_blocks * block_size - int(keep.sum())  # -1 wrote nothing


def test_store_kv_all_skipped_and_empty():
    k_cache = torch.zeros(2, 16, 2, 64)
    v_cache = torch.zeros(2, 16, 2, 64)
    key = torch.ones(3, 2, 64)
    for store in (store_kv_triton, store_kv_ref):
        store(key, key, k_cache, v_cache, torch.full((3,), -1))
        store(key[:0], key[:0], k_cache, v_cache, torch.zeros(0, dtype=torch.int64))
    assert not k_cache.any() and not v_cache.any()


def test_store_kv_rejects_bad_input():
    k_cache = torch.zeros(2, 16, 2, 64)
    with pytest.raises(AssertionError, match="slot_mapping"):
        store_kv_ref(torch.ones(3, 2, 64), torch.ones(3, 2, 64), k_cache, k_cache.clone(),
                     torch.zeros(3, dtype=torch.int32))
    with pytest.raises(AssertionError, match="heads/dim"):
        store_kv_triton(torch.ones(3, 4, 64), torch.ones(3, 4, 64), k_cache, k_cache.clone(),
                        torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_matches_ref(dtype):
    torch.manual_seed(0)
    kv_cache = torch.randn(3, 2, 10, 16, 3, 64).to(dtype)  # [L, 2, NB, BS, KVH, D]
    mapping = torch.tensor([[3, 7], [0, 5], [9, 1], [3, 8]])
    original = kv_cache.clone()
    by_ref = kv_cache.clone()
    copy_blocks_triton(kv_cache, mapping)
    copy_blocks_ref(by_ref, mapping)
    assert torch.equal(kv_cache, by_ref)
    expected = original.clone()
    for src, dst in mapping.tolist():
        expected[:, :, dst] = original[:, :, src]
    assert torch.equal(kv_cache, expected)
    untouched = [b for b in range(10) if b not in mapping[:, 1].tolist()]
    assert torch.equal(kv_cache[:, :, untouched], original[:, :, untouched])


def test_copy_blocks_large_block_and_empty_mapping():
    kv_cache = torch.randn(2, 2, 4, 32, 8, 128)  # block of 32768 elements: several chunks per block
    original = kv_cache.clone()
    copy_blocks_triton(kv_cache, torch.zeros(0, 2, dtype=torch.int64))
    copy_blocks_ref(kv_cache, torch.zeros(0, 2, dtype=torch.int64))
    assert torch.equal(kv_cache, original)
    copy_blocks_triton(kv_cache, torch.tensor([[2, 0]]))
    assert torch.equal(kv_cache[:, :, 0], original[:, :, 2])
    assert torch.equal(kv_cache[:, :, 1:], original[:, :, 1:])
