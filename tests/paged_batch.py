"""A random batch over a paged KV cache, for kernel tests on any device (no environment side effects)."""

from dataclasses import dataclass

import torch

from agentrt.kernels import AttentionMetadata, build_attention_metadata, store_kv_ref


@dataclass
class PagedBatch:
    """A random batch over a paged cache whose unused slots (and block 0, the table padding) hold NaN."""

    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    keys: list[torch.Tensor]  # per sequence [seq_len, KVH, D], same values as in the cache
    values: list[torch.Tensor]
    query_start_loc: list[int]

    def dense(self, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense causal attention of every sequence on inputs cast to `dtype`, concatenated."""
        from agentrt.kernels import dense_causal_attention_ref

        qsl = self.query_start_loc
        return torch.cat([
            dense_causal_attention_ref(self.q[qsl[b]:qsl[b + 1]].to(dtype), self.keys[b].to(dtype),
                                       self.values[b].to(dtype), scale)
            for b in range(len(self.keys))
        ])


def make_paged_batch(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                     block_size: int, dtype: torch.dtype, *, seed: int = 0, spare_blocks: int = 3) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    # Block 0 is never allocated, so reading table padding (value 0) shows up as NaN.
    free = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 2, dtype=torch.int32)
    keys, values = [], []
    for b, seq_len in enumerate(seq_lens):
        ids = [free.pop() for _ in range(blocks_per_seq[b])]
        block_tables[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.tensor([ids[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        store_kv_ref(k, v, k_cache, v_cache, slots)
        keys.append(k)
        values.append(v)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], num_heads, head_dim, generator=gen).to(dtype)
    meta = build_attention_metadata(torch.tensor(qsl), torch.tensor(seq_lens), block_tables,
                                    max(q_lens), max(seq_lens))
    return PagedBatch(q, k_cache, v_cache, meta, keys, values, qsl)


def to_device(batch: PagedBatch, device: str | torch.device) -> PagedBatch:
    """The same batch with q, caches and metadata on `device` (keys/values for the dense reference stay)."""
    m = batch.meta
    meta = build_attention_metadata(m.query_start_loc.to(device), m.seq_lens.to(device), m.block_tables.to(device),
                                    m.max_query_len, m.max_seq_len)
    return PagedBatch(batch.q.to(device), batch.k_cache.to(device), batch.v_cache.to(device), meta,
                      batch.keys, batch.values, batch.query_start_loc)


ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def check_rule(out: torch.Tensor, batch: PagedBatch, scale: float) -> None:
    """flash-attention's rule: err(kernel) <= 2 * err(torch, same dtype) + atol, errors against fp32 dense
    attention; `out` may live on any device (compared on the CPU, where `batch` is)."""
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    out = out.cpu()
    assert not out.isnan().any()
    gold = batch.dense(scale)
    from agentrt.kernels import paged_attention_ref

    same_dtype = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)
    err = (out.float() - gold).abs().max().item()
    err_torch = (same_dtype.float() - gold).abs().max().item()
    assert err <= 2 * err_torch + ATOL[batch.q.dtype], f"err {err:.3g} vs torch {err_torch:.3g}"
