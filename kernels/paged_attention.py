"""paged_attention: causal attention of a mixed batch (prefill chunks + decode tokens) over a paged KV cache.

Batch layout (`AttentionMetadata`): the query rows of sequence b are `q[qsl[b]:qsl[b+1]]`; row i of
them sits at absolute position `seq_lens[b] - q_len_b + i` and attends to KV positions `0..pos`.
The KV of sequence b lives in the cache blocks `block_tables[b, :ceil(seq_len/block_size)]`; the
new tokens' K/V were already written by `store_kv`. GQA: query head h reads kv head `h // (H // KVH)`.

Triton algorithm: grid (query tile [x split], kv head). A tile packs `BLOCK_M` rows of (query
token, head of the GQA group) pairs of one sequence, so all query heads sharing a kv head read each
K/V page once. Tiles are numbered across the batch (`tile_start_loc`, a prefix sum of each
sequence's tile count, built once per step); a program finds its sequence by counting the
sequences that end before its tile, so a mixed batch launches about `T * GROUP / BLOCK_M + B`
programs per kv head, not `B * max_query_len * GROUP / BLOCK_M`. The program walks the KV
positions `0..max position of the tile` in `BLOCK_N` steps, reading block ids from the block
table, with an online (exp2) softmax accumulated in fp32; KV tiles past the tile's last position
are never visited. Split-K (flash-decoding): with `num_splits > 1` each program handles one slice
of the KV range and writes a normalized partial output plus its log-sum-exp; `_merge_splits_kernel`
combines the slices. The launcher picks it for decode-only batches whose sequences x kv heads
cannot fill the GPU and whose contexts are long.

Memory traffic: each K/V element of a sequence is read once per (query tile, kv head) that reaches
it: once for decode, ceil(q_len * GROUP / BLOCK_M) times for a prefill chunk. Split-K adds
2 * num_splits * T * H * (D + 1) fp32 of partial results.

Layer features (every path: Triton, the C++ CPU kernels, torch): `window` W (a row at position p sees
positions p - W + 1 .. p, HF's sliding-window convention: `kv > q - W`), `sinks` (one learned logit per
query head added to the softmax's denominator as an extra, value-less key, gpt-oss), `softcap` c (scores
become c * tanh(score / c) before masking, Gemma 2). A windowed Triton tile starts its KV walk at the
window of its first row, so a sliding-window layer reads O(W) positions per query whatever the context.

Limits: head_dim <= 256 (any, padded to a power of two); q/out unit stride along head_dim; cache
unit stride along head_dim; `query_start_loc[-1] == q.shape[0]` (rows outside any sequence are left
unwritten); up to ~B programs per kv head find no tile and exit at once.

`paged_attention_ref` is the reference: per sequence, its blocks gathered and SDPA in the input
dtype (torch's own rounding, the yardstick of the kernel tests). The CPU production path (C++
kernel for decode, SDPA for prefill) is `kernels.paged_attention_cpu`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from agentrt.kernels._common import launchable

_LOG2E = 1.4426950408889634
_LOG2E_K = tl.constexpr(_LOG2E)  # the same, readable inside @triton.jit kernels (globals must be constexpr)


@dataclass(slots=True)
class AttentionMetadata:
    """Where each sequence's queries and KV blocks are; built once per step, shared by all layers."""

    query_start_loc: torch.Tensor  # [B+1] int32, cumulative query lengths; seq b owns q[qsl[b]:qsl[b+1]]
    seq_lens: torch.Tensor  # [B] int32, total KV length of seq b including its new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32; entries past ceil(seq_len/block_size) are padding
    max_query_len: int  # max over b of qsl[b+1] - qsl[b] (python int: no device sync)
    max_seq_len: int  # max over b of seq_lens[b]
    batch_invariant: bool = False  # each row's output independent of the step's other rows (CPU kernels only)
    _cpu_plan: Any = field(default=None, repr=False, compare=False)  # kernels.paged_attention_cpu, lazily built
    _tile_start_loc: dict[tuple[int, int], torch.Tensor] = field(  # Triton: per (GROUP, BLOCK_M), lazily built
        default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def build_attention_metadata(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                             max_query_len: int, max_seq_len: int, batch_invariant: bool = False) -> AttentionMetadata:
    """Check shapes and build an `AttentionMetadata` (index tensors are converted to int32). `batch_invariant`:
    the CPU kernels compute each query row the same way whatever else the step holds (how many rows, split
    how, decode or prefill), at some cost in speed (kernels.paged_attention_cpu)."""
    num_seqs = seq_lens.shape[0]
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [B+1] and seq_lens [B]; got {tuple(query_start_loc.shape)} "
                         f"and {tuple(seq_lens.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [B={num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    if max_query_len < 0 or max_seq_len < max_query_len:
        raise ValueError(f"need 0 <= max_query_len <= max_seq_len, got {max_query_len} and {max_seq_len}")
    return AttentionMetadata(
        query_start_loc=query_start_loc.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        block_tables=block_tables.to(torch.int32).contiguous(),
        max_query_len=int(max_query_len),
        max_seq_len=int(max_seq_len),
        batch_invariant=bool(batch_invariant),
    )


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    assert q.dim() == 3, f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        f"k_cache/v_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got "
        f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    assert k_cache.shape[3] == head_dim, f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    assert q.dtype == k_cache.dtype == v_cache.dtype, (
        f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    for name in ("query_start_loc", "seq_lens", "block_tables"):
        t = getattr(meta, name)
        assert t.dtype == torch.int32 and t.device == q.device, (
            f"{name} must be int32 on {q.device}, got {t.dtype} on {t.device}")
    assert meta.query_start_loc.shape == (meta.num_seqs + 1,) and meta.block_tables.shape[0] == meta.num_seqs


def check_features(q: torch.Tensor, window: int | None, sinks: torch.Tensor | None,
                   softcap: float | None) -> tuple[int, torch.Tensor | None, float]:
    """Validate a layer's attention features; returns (window, 0 = none; sinks as [H] fp32 contiguous or None;
    softcap, 0.0 = none)."""
    if window is not None and (isinstance(window, bool) or int(window) != window or window < 1):
        raise ValueError(f"window must be a positive number of positions or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap!r}")
    if sinks is not None:
        if sinks.shape != (q.shape[1],):
            raise ValueError(f"sinks must be [num_heads={q.shape[1]}], got {tuple(sinks.shape)}")
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    return int(window or 0), sinks, float(softcap or 0.0)



# ---------------------------------------------------------------------------------------------- Triton


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    tile_start_loc_ptr,  # [B+1] int32, prefix sum of cdiv(q_len * GROUP, BLOCK_M)
    sinks_ptr,  # [H] fp32 sink logits (HAS_SINKS only)
    qk_scale,  # softmax scale * log2(e)
    softcap,  # SOFTCAP only: scores become softcap * tanh(score / softcap), in natural-log units
    window,  # > 0: a row at position p sees positions p - window + 1 .. p
    num_seqs,
    num_splits,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_os, stride_ot, stride_oh,  # out [T, H, D], or partial out [S, T, H, D] when SPLIT_K
    stride_ls, stride_lt,  # lse [S, T, H] (SPLIT_K only)
    stride_bt,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    PAGE_SIZE: tl.constexpr,  # cache block size
    BLOCK_M: tl.constexpr,  # packed (token, group head) rows per tile
    BLOCK_N: tl.constexpr,  # KV positions per step
    SEQS_P2: tl.constexpr,  # next power of two >= num_seqs
    SPLIT_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # matmul operand dtype: the input dtype, except bf16 in the interpreter
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)
    tl.static_assert(HEAD_DIM_P2 >= HEAD_DIM)
    tile = tl.program_id(0) // num_splits
    split = (tl.program_id(0) % num_splits).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_ids = tl.arange(0, SEQS_P2)
    tile_ends = tl.load(tile_start_loc_ptr + 1 + seq_ids, mask=seq_ids < num_seqs, other=2**31 - 1)
    seq = tl.sum((tile_ends <= tile).to(tl.int32), 0)  # sequences whose tiles all come before this one
    if seq >= num_seqs:
        return
    tile -= tl.load(tile_start_loc_ptr + seq)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    row0 = tile * BLOCK_M
    if row0 >= q_len * GROUP:
        return

    rows = row0 + tl.arange(0, BLOCK_M)
    token = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_mask = token < q_len
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_mask = dims < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    q_pos = context_len + token

    # Keys past the tile's last query position are masked for every row: never visit them.
    kv_end = tl.minimum(seq_len, context_len + (row0 + BLOCK_M - 1) // GROUP + 1)
    win_lo = 0  # first position any row of the tile sees
    if window > 0:
        win_lo = tl.maximum(context_len + row0 // GROUP - window + 1, 0)
    kv_lo = win_lo
    kv_hi = kv_end
    if SPLIT_K:
        per_split = tl.cdiv(tl.cdiv(kv_end - win_lo, num_splits), BLOCK_N) * BLOCK_N
        kv_lo = win_lo + split * per_split
        kv_hi = tl.minimum(kv_end, kv_lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_mask = pos < kv_hi
        block = tl.load(table + pos // PAGE_SIZE, mask=pos_mask, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_head + block[:, None] * stride_kb + slot[:, None] * stride_ks + dims[None, :],
                    mask=kv_mask, other=0.0)
        qk = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:  # c * tanh(x / c) in log2 units, tanh(y) = 1 - 2 / (e^2y + 1) (saturates, no nan)
            qk = softcap * _LOG2E_K * (1.0 - 2.0 / (tl.exp2(qk * (2.0 / softcap)) + 1.0))
        attend = pos_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if window > 0:
            attend = attend & (pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(attend, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + block[:, None] * stride_vb + slot[:, None] * stride_vs + dims[None, :],
                    mask=kv_mask, other=0.0)
        p = p.to(v.dtype).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    if HAS_SINKS and not SPLIT_K:  # the sink: a key of logit sinks[head] and no value (merged later when split)
        sink = tl.load(sinks_ptr + head, mask=row_mask, other=0.0) * 1.4426950408889634
        m_all = tl.maximum(m_i, sink)
        rescale = tl.exp2(m_i - m_all)
        acc = acc * rescale[:, None]
        l_i = l_i * rescale + tl.exp2(sink - m_all)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    out_off = q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if SPLIT_K:
        tl.store(out_ptr + split * stride_os + out_off, out, mask=out_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(lse_ptr + split * stride_ls + q_rows * stride_lt + head, lse, mask=row_mask)
    else:
        tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, sinks_ptr,
    num_splits,
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2)
    split_mask = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_mask = dims < HEAD_DIM
    lse = tl.load(lse_ptr + splits * stride_ls + token * stride_lt + head, mask=split_mask, other=float("-inf"))
    # Split 0 always sees position 0, so the max is finite and empty splits get weight exp2(-inf) = 0.
    top = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        top = tl.maximum(top, sink)
    weight = tl.exp2(lse - top)
    part = tl.load(part_ptr + splits[:, None] * stride_ps + token * stride_pt + head * stride_ph + dims[None, :],
                   mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    total = tl.sum(weight, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - top)
    out = tl.sum(part * weight[:, None], 0) / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_LAUNCH_KEYS = ("block_m", "block_n", "num_warps", "num_stages")
_launch_override: dict[str, int] = {}  # set by `launch_config` (benchmarks sweep tile shapes with it)
_SPLIT_MIN_CONTEXT = 1024  # shorter decode contexts are not worth a second kernel
_SPLIT_MIN_TOKENS = 256  # KV positions per split at least
_MAX_SPLITS = 64
_DECODE_WIDE_PROGRAMS_PER_SM = 4  # decode launches with at most this many programs per SM use block_n 128


@contextlib.contextmanager
def launch_config(**config: int) -> Iterator[None]:
    """Force the Triton kernel's tile shape inside a `with` block, for tuning sweeps: any of `block_m`
    (packed query rows per tile, >= 16), `block_n` (KV positions per step, >= 16), `num_warps`, `num_stages`."""
    bad = set(config) - set(_LAUNCH_KEYS)
    if bad:
        raise ValueError(f"unknown launch settings {sorted(bad)}; expected some of {', '.join(_LAUNCH_KEYS)}")
    previous = dict(_launch_override)
    _launch_override.update(config)
    try:
        yield
    finally:
        _launch_override.clear()
        _launch_override.update(previous)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 16
    return torch.cuda.get_device_properties(device).multi_processor_count


def _auto_num_splits(meta: AttentionMetadata, num_kv_heads: int, device: torch.device) -> int:
    if meta.max_query_len != 1 or meta.max_seq_len < _SPLIT_MIN_CONTEXT:
        return 1
    programs = meta.num_seqs * num_kv_heads
    sms = _num_sms(device)
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), meta.max_seq_len // _SPLIT_MIN_TOKENS, _MAX_SPLITS))


def _tile_start_loc(meta: AttentionMetadata, group: int, block_m: int) -> torch.Tensor:
    """[B+1] int32 prefix sum of the query tiles of each sequence; built on device, once per step."""
    key = (group, block_m)
    if key not in meta._tile_start_loc:
        q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        tiles = torch.div(q_lens * group + block_m - 1, block_m, rounding_mode="floor")
        meta._tile_start_loc[key] = F.pad(torch.cumsum(tiles, 0, dtype=torch.int32), (1, 0))
    return meta._tile_start_loc[key]


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, *, window: int | None = None,
                           sinks: torch.Tensor | None = None, softcap: float | None = None,
                           num_splits: int | None = None) -> torch.Tensor:
    """Triton launcher. q: [T, H, D] -> out [T, H, D]. `num_splits`: None = auto, 1 = off, n = force n.
    `window`, `sinks` [H], `softcap`: the layer's features (module docstring)."""
    _check(q, k_cache, v_cache, meta)
    window, sinks, softcap = check_features(q, window, sinks, softcap)
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "head_dim must be unit-stride"
    assert meta.block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert head_dim <= 256, f"head_dim {head_dim} > 256 is not supported"
    assert q.dtype in _TL_DTYPES, f"unsupported dtype {q.dtype}"
    group = num_heads // num_kv_heads
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = _auto_num_splits(meta, num_kv_heads, q.device)
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"

    rows = meta.max_query_len * group
    block_m = _launch_override.get("block_m", 16 if rows <= 16 else 64)
    tile_start_loc = _tile_start_loc(meta, group, block_m)
    num_tiles = min(triton.cdiv(num_tokens * group, block_m) + meta.num_seqs,
                    meta.num_seqs * triton.cdiv(rows, block_m))
    head_dim_p2 = triton.next_power_of_2(head_dim)
    wide = q.element_size() == 4 or head_dim_p2 > 128
    # Decode tiles (16 rows) in 16-bit with few programs per SM stream 128 KV positions per step: more
    # bytes in flight per SM (H200, Llama-3.1-8B shape: 75% -> 89% of copy bandwidth at batch 32 x 4k);
    # with many programs per SM 64 is as fast or a little faster (103% vs 100% at batch 128 x 4k).
    few_programs = num_tiles * num_splits * num_kv_heads <= _DECODE_WIDE_PROGRAMS_PER_SM * _num_sms(q.device)
    block_n = _launch_override.get("block_n", 128 if block_m == 16 and not wide and few_programs else 64)
    split_k = num_splits > 1
    dot_dtype = _TL_DTYPES[q.dtype]
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":
        dot_dtype = tl.float32  # the interpreter multiplies bf16 as raw uint16 bits
    if split_k:
        target = torch.empty(num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_splits, num_tokens, num_heads, dtype=torch.float32, device=q.device)
    else:
        target, lse = out, out  # lse is unused without split-K
    grid = (num_tiles * num_splits, num_kv_heads)
    launchable(_paged_attention_kernel, q.device)[grid](
        q, k_cache, v_cache, target, lse,
        meta.query_start_loc, meta.seq_lens, meta.block_tables, tile_start_loc, sinks if sinks is not None else q,
        scale * _LOG2E, softcap, window, meta.num_seqs, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        target.stride(0) if split_k else 0, target.stride(-3), target.stride(-2),
        lse.stride(0) if split_k else 0, lse.stride(1) if split_k else 0,
        meta.block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SEQS_P2=triton.next_power_of_2(meta.num_seqs),
        SPLIT_K=split_k,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not None,
        num_warps=_launch_override.get("num_warps", 4),
        num_stages=_launch_override.get("num_stages", 1 if wide else 2),
    )
    if split_k:
        launchable(_merge_splits_kernel, q.device)[(num_tokens, num_heads)](
            target, lse, out, sinks if sinks is not None else lse,
            num_splits,
            target.stride(0), target.stride(1), target.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_P2=head_dim_p2,
            SPLITS_P2=max(2, triton.next_power_of_2(num_splits)),
            HAS_SINKS=sinks is not None,
            num_warps=1 if head_dim_p2 <= 64 else 2,
        )
    return out


# ---------------------------------------------------------------------------------------------- reference


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, *, window: int | None = None,
                        sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """The reference: per sequence, gather its blocks and run SDPA with the causal offset, in q's dtype; with
    a layer feature (`window`, `sinks`, `softcap`), the softmax written out in fp32 instead.
    q: [T, H, D] -> out [T, H, D]. Rows outside any sequence are left zero."""
    _check(q, k_cache, v_cache, meta)
    window, sinks, softcap = check_features(q, window, sinks, softcap)
    featured = window > 0 or sinks is not None or softcap > 0
    num_heads, block_size, num_kv_heads = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q)
    qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q0, q1 = qsl[b], qsl[b + 1]
        if q1 == q0:
            continue
        blocks = meta.block_tables[b, : triton.cdiv(seq_len, block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:seq_len]  # [L, KVH, D]
        v = v_cache[blocks].flatten(0, 1)[:seq_len]
        if featured:
            out[q0:q1] = dense_causal_attention_ref(q[q0:q1], k, v, scale, window=window, sinks=sinks, softcap=softcap)
            continue
        q_pos = torch.arange(seq_len - (q1 - q0), seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
        out[q0:q1] = o[0].transpose(0, 1)
    return out


def dense_causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                               window: int = 0, sinks: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of one sequence, softmax materialized in fp32.

    q: [Lq, H, D] are the last Lq positions of k, v: [Lk, KVH, D]. Returns [Lq, H, D] in q's dtype.
    `window` > 0: a row at position p sees p - window + 1 .. p; `sinks` [H]: a value-less key of that logit
    per head; `softcap` > 0: scores c * tanh(score / c).
    """
    q_len, num_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
    kv_pos = torch.arange(kv_len, device=q.device)[None, :]
    visible = kv_pos <= q_pos[:, None]
    if window:
        visible &= kv_pos > q_pos[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(num_heads, 1, 1).expand(num_heads, q_len, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :kv_len]
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
