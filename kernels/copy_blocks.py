"""copy_blocks: copy whole KV blocks (all layers, K and V) for copy-on-write forks.

`kv_cache` is the engine's single tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]`; `block_mapping` is `[N, 2]` int64 rows `(src, dst)`.

Algorithm: grid (pair, layer * 2 + kv, chunk); each program copies one chunk of `CHUNK` elements
of one block. Memory traffic: N * L * 2 * block_numel elements read and written.
Limits: `kv_cache` contiguous; destinations distinct and never a source in the same call (the
programs run concurrently; the reference copies from a snapshot, and both agree under this rule,
which copy-on-write satisfies because destinations are freshly allocated blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt.kernels._common import launchable


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,
    mapping_ptr,
    stride_layer,
    stride_kv,
    stride_block,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    tl.static_assert(CHUNK & (CHUNK - 1) == 0)
    pair = tl.program_id(0).to(tl.int64)
    layer_kv = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(mapping_ptr + 2 * pair)
    dst = tl.load(mapping_ptr + 2 * pair + 1)
    base = (layer_kv // 2) * stride_layer + (layer_kv % 2) * stride_kv
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    x = tl.load(cache_ptr + base + src * stride_block + offs, mask=mask)
    tl.store(cache_ptr + base + dst * stride_block + offs, x, mask=mask)


def _check(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    assert kv_cache.dim() == 6 and kv_cache.shape[1] == 2, (
        f"kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], "
        f"got {tuple(kv_cache.shape)}")
    assert block_mapping.dim() == 2 and block_mapping.shape[1] == 2 and block_mapping.dtype == torch.int64, (
        f"block_mapping must be [N, 2] int64 (src, dst), got {tuple(block_mapping.shape)} {block_mapping.dtype}")
    assert block_mapping.device == kv_cache.device


def copy_blocks_triton(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Triton launcher."""
    _check(kv_cache, block_mapping)
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    block_mapping = block_mapping.contiguous()
    num_layers = kv_cache.shape[0]
    block_numel = kv_cache[0, 0, 0].numel()
    chunk = min(2048, triton.next_power_of_2(block_numel))
    grid = (num_pairs, num_layers * 2, triton.cdiv(block_numel, chunk))
    launchable(_copy_blocks_kernel, kv_cache.device)[grid](
        kv_cache, block_mapping,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        BLOCK_NUMEL=block_numel,
        CHUNK=chunk,
        num_warps=4,
    )


def copy_blocks_ref(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Pure-torch reference (and the CPU production path): gather the sources, scatter to the destinations."""
    _check(kv_cache, block_mapping)
    if block_mapping.shape[0] == 0:
        return
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    kv_cache.index_copy_(2, dst, kv_cache.index_select(2, src))
