"""store_kv: write the new tokens' keys and values into the paged KV cache.

Cache layout (one layer): `k_cache`, `v_cache` of shape `[num_blocks, block_size, num_kv_heads,
head_dim]`, contiguous. Token t goes to `slot = slot_mapping[t] = block_id * block_size + offset`;
slot -1 means "do not store" (padding tokens, or tokens whose KV is already cached).

Algorithm: one program per token; it loads the token's `[num_kv_heads, head_dim]` key and value
tiles (rows may be strided views into a fused qkv projection) and stores them at the slot.
Memory traffic: 2 * T * num_kv_heads * head_dim elements read and written, once each.
Limits: the cache is contiguous in its last three dims; key/value have unit stride along head_dim;
slots must be distinct (two tokens writing the same slot race).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt.kernels._common import launchable


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
):
    tl.static_assert(HEADS_P2 >= NUM_KV_HEADS)
    tl.static_assert(HEAD_DIM_P2 >= HEAD_DIM)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_P2)
    dims = tl.arange(0, HEAD_DIM_P2)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    cache_off = (
        block * stride_cache_block
        + offset * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_off, k, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + cache_off, v, mask=mask)


def _check(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    assert key.dim() == 3 and key.shape == value.shape, (
        f"key/value must be [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)} and {tuple(value.shape)}")
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        f"k_cache/v_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got "
        f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    assert key.shape[1:] == k_cache.shape[2:], (
        f"key heads/dim {tuple(key.shape[1:])} do not match the cache's {tuple(k_cache.shape[2:])}")
    assert key.dtype == value.dtype == k_cache.dtype == v_cache.dtype, (
        f"dtypes differ: key {key.dtype}, value {value.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    assert slot_mapping.shape == (key.shape[0],) and slot_mapping.dtype == torch.int64, (
        f"slot_mapping must be [{key.shape[0]}] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    assert key.device == value.device == k_cache.device == v_cache.device == slot_mapping.device


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Triton launcher. key/value: [T, KVH, D] (any row/head stride, unit dim stride)."""
    _check(key, value, k_cache, v_cache, slot_mapping)
    assert key.stride(2) == 1 and value.stride(2) == 1, "key/value need unit stride along head_dim"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache/v_cache must be contiguous"
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    kernel = launchable(_store_kv_kernel, key.device)
    kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P2=triton.next_power_of_2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Pure-torch reference (and the CPU production path): one index_copy_ per cache."""
    _check(key, value, k_cache, v_cache, slot_mapping)
    _, _, num_kv_heads, head_dim = k_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
