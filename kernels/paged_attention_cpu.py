"""paged_attention_cpu: the production path of `paged_attention` off the GPU (kernels.paged_attention holds
the batch layout, the Triton kernel and the reference).

Runs on any device in pure torch; on CPU with the C++ kernels built (kernels/cpu.py):
- bf16 on AVX512-BF16: every sequence goes to the tiled kernel `paged_attention_bf16` (bf16 dot
  products, K and V packed per sequence and kv head, online softmax; decode and prefill alike);
- otherwise (fp32, or bf16 without AVX512-BF16), sequences with at most `CPP_MAX_QUERY_ROWS` query
  rows (decode, draft verification) go to `paged_attention_small_q`, which reads each sequence's
  blocks once straight from the cache (a bf16 cache is read as bf16: half the bytes of fp32), and
  longer query runs (prefill chunks) take SDPA as below.

The torch path (no C++ kernels, or other dtypes): per call one gather of whole KV blocks and one
attention per group of decode rows of similar length, and one of each for all prefill rows (padded
to `[B, max_q]` with a causal mask); the index tensors and masks are built once per step and cached
in the metadata, so every layer reuses them. Decode rows in fp32 with few kv heads (<= 4) skip SDPA,
whose CPU kernel runs a 3-row query at ~5 GFLOP/s: each sequence's gathered K/V stay `[L, KVH * D]`
rows and a query head is zero outside its kv head's slice of width D, so two plain batched GEMMs
(`q @ K.T`, `p @ V`) cover all heads at once and the wanted `[H, D]` blocks are read off the result.
It does KVH times the needed FLOPs but reads K/V once, contiguously: ~1.6x faster than SDPA for 32
sequences of ~400 tokens (9 / 3 heads, D 64) on 2 cores.

A layer with features (sliding `window`, attention `sinks`, `softcap`): sequences with up to
`CPP_MAX_QUERY_ROWS` rows go to `paged_attention_small_q`, which takes all three (its walk starts at the
window's first block); longer runs, and every row without the C++ kernels, go one sequence at a time to
SDPA over the positions the window can see (a sink is one more key of zeros whose additive mask is its
logit), or, with a softcap, to the fp32 softmax written out in chunks of query rows. In bf16 on AVX512-BF16
a layer with a window alone (Gemma 3's local layers, Mistral's) goes to the tiled kernel like any other
(every row's walk starts at the tile of its window); it does not take sinks or a softcap yet.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from agentrt.kernels import cpu
from agentrt.kernels.paged_attention import AttentionMetadata, _check, check_features, dense_causal_attention_ref


@dataclass(slots=True)
class _Part:
    """Precomputed indices of the torch path for one kind of rows (decode or prefill)."""

    rows: torch.Tensor  # [R] int64, rows of q (and out) this part produces
    blocks: torch.Tensor  # [S, nblk] int64, cache blocks to gather (table padding -> a valid block)
    pad_slots: torch.Tensor  # [P] int64, flat gathered positions past seq_len, zeroed after gathering
    mask: torch.Tensor  # decode [S, 1, 1, L] / prefill [S, 1, max_q, L] bool, True = attend
    q_index: torch.Tensor | None  # prefill: [S * max_q] rows of q to gather (padding repeats the last)
    out_index: torch.Tensor | None  # prefill: [R] positions of `rows` in the padded [S * max_q] output
    max_q: int  # query rows per sequence after padding
    equal_len: int | None = None  # decode: the common seq_len when all are equal (no mask, no padding)
    in_order: bool = False  # decode: rows are 0..S-1, i.e. the whole batch is decode rows in order


@dataclass(slots=True)
class _CpuPlan:
    block_size: int  # cache block size the plan was built for
    use_cpp: bool  # few-row sequences go to the C++ kernel (kernels/cpu.py)
    decode: list[_Part]  # torch path: sequences with exactly one query row, in groups of similar length
    prefill: _Part | None  # sequences with more query rows (C++ path: more than CPP_MAX_QUERY_ROWS)
    small_seqs: torch.Tensor | None = None  # C++ path: [S] int64, sequences with 1..CPP_MAX_QUERY_ROWS rows
    tiled: bool = False  # bf16 on AVX512-BF16: every sequence goes to the tiled C++ kernel
    tiled_seqs: torch.Tensor | None = None  # tiled C++ kernel: [S] int64, sequences with query rows
    prefill_each: list[tuple[_Part, int, int, bool]] | None = None  # torch path, SDPA per prefill sequence:
    # (its part, first and end row of q, whether it is a fresh prompt: q_len == seq_len, so plainly causal)
    pieces: tuple[torch.Tensor, ...] | None = None  # batch-invariant small_q path: (query_start_loc, seq_lens,
    # block_tables, seqs) of every sequence cut in runs of at most CPP_MAX_QUERY_ROWS rows (`_row_pieces`)


def _build_part(meta: AttentionMetadata, seqs: torch.Tensor, block_size: int, decode: bool) -> _Part:
    device = meta.seq_lens.device
    qsl = meta.query_start_loc.long()
    q_start = qsl[seqs]
    q_lens = qsl[seqs + 1] - q_start
    seq_lens = meta.seq_lens.long()[seqs]
    num_blocks = triton.cdiv(int(seq_lens.max()), block_size)
    assert num_blocks <= meta.block_tables.shape[1], (
        f"seq_len {int(seq_lens.max())} needs {num_blocks} blocks, block_tables has {meta.block_tables.shape[1]}")
    blocks = meta.block_tables[seqs, :num_blocks].long()
    used = torch.arange(num_blocks, device=device)[None, :] < triton.cdiv(seq_lens, block_size)[:, None]
    blocks = torch.where(used, blocks, blocks[:, :1])
    kv_pos = torch.arange(num_blocks * block_size, device=device)
    valid = kv_pos[None, :] < seq_lens[:, None]  # [S, L]
    pad_slots = (~valid).flatten().nonzero().squeeze(1)
    if decode:
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        num_rows = int(qsl[-1])
        return _Part(rows=q_start, blocks=blocks, pad_slots=pad_slots, mask=valid[:, None, None, :],
                     q_index=None, out_index=None, max_q=1, equal_len=hi if lo == hi else None,
                     in_order=num_rows == seqs.shape[0] and bool((q_start == torch.arange(num_rows, device=device)).all()))
    max_q = int(q_lens.max())
    i = torch.arange(max_q, device=device)[None, :]
    real = i < q_lens[:, None]  # [S, max_q]
    row_i = torch.minimum(i, q_lens[:, None] - 1)  # padding rows repeat the last real row
    q_pos = (seq_lens - q_lens)[:, None] + row_i
    mask = kv_pos[None, None, :] <= q_pos[:, :, None]  # [S, max_q, L]; implies kv_pos < seq_len
    return _Part(
        rows=(q_start[:, None] + i)[real],
        blocks=blocks,
        pad_slots=pad_slots,
        mask=mask[:, None],
        q_index=(q_start[:, None] + row_i).flatten(),
        out_index=real.flatten().nonzero().squeeze(1),
        max_q=max_q,
    )


# A decode group pads every sequence to its longest one; a new group costs a dozen more ops per
# layer (~0.2 ms on 2 cores), about what gathering and multiplying 256 padded positions costs.
_DECODE_GROUP_SLACK = 256


def _decode_groups(meta: AttentionMetadata, seqs: torch.Tensor, block_size: int) -> list[_Part]:
    """Split decode sequences into groups whose lengths differ by at most `_DECODE_GROUP_SLACK`,
    so padding stays small when short and long contexts decode together (one group, in batch
    order, when they are all alike)."""
    lens = meta.seq_lens.long()[seqs]
    if int(lens.max()) - int(lens.min()) <= _DECODE_GROUP_SLACK:
        return [_build_part(meta, seqs, block_size, True)]
    order = torch.argsort(lens, descending=True, stable=True)
    sorted_lens = lens[order].tolist()
    groups, start = [], 0
    for i in range(1, len(sorted_lens) + 1):
        if i == len(sorted_lens) or sorted_lens[start] - sorted_lens[i] > _DECODE_GROUP_SLACK:
            groups.append(_build_part(meta, seqs[order[start:i]], block_size, True))
            start = i
    return groups


CPP_MAX_QUERY_ROWS = 16  # query rows per sequence up to which the C++ kernel takes it (decode, drafts)
_CPP_HEAD_DIMS = (32, 64, 128, 256)


def _prefill_parts(meta: AttentionMetadata, seqs: torch.Tensor, block_size: int) -> tuple[_Part | None, list | None]:
    """The torch path's prefill rows: one padded SDPA call for all sequences, or one call per sequence
    when padding to the longest would more than double the work (SDPA's CPU kernel runs a padded
    masked batch at about the rate of separate unpadded calls)."""
    if not seqs.numel():
        return None, None
    qsl = meta.query_start_loc.long()
    q_lens, lens = (qsl[seqs + 1] - qsl[seqs]).tolist(), meta.seq_lens.long()[seqs].tolist()
    if len(q_lens) > 1 and 2 * sum(q * n for q, n in zip(q_lens, lens)) < len(q_lens) * max(q_lens) * max(lens):
        starts = qsl[seqs].tolist()
        return None, [(_build_part(meta, seqs[i : i + 1], block_size, False), starts[i], starts[i] + q_lens[i],
                       q_lens[i] == lens[i]) for i in range(len(q_lens))]
    return _build_part(meta, seqs, block_size, False), None


def _row_pieces(meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
    """Every sequence's query rows in runs of at most CPP_MAX_QUERY_ROWS, each run a sequence of its own for
    `paged_attention_small_q`: rows [a, e) of a sequence of R rows and L positions see what they saw in it,
    so the run's seq_len is L - R + e; the runs tile the rows of q in order, as sequences do."""
    qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    starts, run_lens, owners = [], [], []
    for b, length in enumerate(lens):
        rows = qsl[b + 1] - qsl[b]
        for a in range(0, rows, CPP_MAX_QUERY_ROWS):
            end = min(a + CPP_MAX_QUERY_ROWS, rows)
            starts.append(qsl[b] + a)
            run_lens.append(length - rows + end)
            owners.append(b)
    device = meta.seq_lens.device
    run_qsl = torch.tensor([*starts, qsl[-1]] if starts else [0], dtype=torch.int32, device=device)
    owner = torch.tensor(owners, dtype=torch.long, device=device)
    return (run_qsl, torch.tensor(run_lens, dtype=torch.int32, device=device),
            meta.block_tables.index_select(0, owner).contiguous(), torch.arange(len(owners), device=device))


def _cpu_plan(meta: AttentionMetadata, block_size: int, use_cpp: bool, tiled: bool) -> _CpuPlan:
    plan = meta._cpu_plan
    if plan is None:
        qsl = meta.query_start_loc.long()
        q_lens = qsl[1:] - qsl[:-1]
        if use_cpp:
            if tiled:  # the tiled bf16 kernel takes every row
                plan = _CpuPlan(block_size=block_size, use_cpp=True, decode=[], prefill=None, tiled=True,
                                small_seqs=q_lens[:0], tiled_seqs=(q_lens >= 1).nonzero().squeeze(1))
            elif meta.batch_invariant:  # every row through small_q (no SDPA: it sums in another order)
                plan = _CpuPlan(block_size=block_size, use_cpp=True, decode=[], prefill=None, small_seqs=q_lens[:0],
                                pieces=_row_pieces(meta))
            else:
                small = ((q_lens >= 1) & (q_lens <= CPP_MAX_QUERY_ROWS)).nonzero().squeeze(1)
                prefill_seqs = (q_lens > CPP_MAX_QUERY_ROWS).nonzero().squeeze(1)
                plan = _CpuPlan(block_size=block_size, use_cpp=True, decode=[], prefill=None, small_seqs=small)
                plan.prefill, plan.prefill_each = _prefill_parts(meta, prefill_seqs, block_size)
        else:
            decode_seqs = (q_lens == 1).nonzero().squeeze(1)
            prefill_seqs = (q_lens > 1).nonzero().squeeze(1)
            plan = _CpuPlan(
                block_size=block_size,
                use_cpp=False,
                decode=_decode_groups(meta, decode_seqs, block_size) if decode_seqs.numel() else [],
                prefill=None,
            )
            plan.prefill, plan.prefill_each = _prefill_parts(meta, prefill_seqs, block_size)
        meta._cpu_plan = plan
    assert plan.block_size == block_size, f"metadata planned for block size {plan.block_size}, cache has {block_size}"
    assert (plan.use_cpp, plan.tiled) == (use_cpp, tiled), "metadata planned for another attention path"
    return plan


def _gather(cache: torch.Tensor, part: _Part, flat: bool = False) -> torch.Tensor:
    """[S, KVH, L, D] (`flat`: [S, L, KVH * D]): the KV positions of each sequence, zeros past its
    length (or, when all sequences have the same length, exactly L = that length: no padding)."""
    num_seqs, num_blocks = part.blocks.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    x = cache.index_select(0, part.blocks.flatten()).view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    if part.equal_len is not None:
        x = x[:, : part.equal_len]
    elif part.pad_slots.numel():
        # Never let stale (possibly non-finite) slots reach the matmuls: 0 * nan would poison the row.
        x.view(-1, num_kv_heads, head_dim).index_fill_(0, part.pad_slots, 0)
    return x.flatten(2) if flat else x.transpose(1, 2)


_BLOCK_DIAG_MAX_KV_HEADS = 4  # more kv heads: the KVH-fold FLOPs outweigh SDPA's overhead


@functools.lru_cache(maxsize=16)
def _head_layout(num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device):
    """([H, KVH * D] fp32 mask: 1 where query head h's kv head owns the column; [1, H, 1, 1] kv head of h)."""
    kv_of_head = torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)
    owner = torch.arange(num_kv_heads * head_dim, device=device) // head_dim
    return (owner[None, :] == kv_of_head[:, None]).float(), kv_of_head.view(1, num_heads, 1, 1)


def _decode_block_diag(q_dec: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, part: _Part,
                       scale: float) -> torch.Tensor:
    """fp32 decode attention with two batched GEMMs over `[S, L, KVH * D]` K/V. q_dec: [S, H, D] -> [S, H, D]."""
    num_seqs, num_heads, head_dim = q_dec.shape
    num_kv_heads = k_cache.shape[2]
    k = _gather(k_cache, part, flat=True)  # [S, L, KVH * D]
    v = _gather(v_cache, part, flat=True)
    mask, kv_of_head = _head_layout(num_heads, num_kv_heads, head_dim, q_dec.device)
    qe = q_dec.repeat(1, 1, num_kv_heads).mul_(mask)  # [S, H, KVH * D], zero outside each head's kv slice
    scores = torch.bmm(qe.mul_(scale), k.transpose(1, 2))  # [S, H, L]
    if part.equal_len is None:
        scores.masked_fill_(part.mask.view(num_seqs, 1, -1).logical_not(), float("-inf"))
    out = torch.bmm(scores.softmax(-1), v).view(num_seqs, num_heads, num_kv_heads, head_dim)
    return out.gather(2, kv_of_head.expand(num_seqs, num_heads, 1, head_dim)).view(num_seqs, num_heads, head_dim)


def _cpp_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and q.shape[-1] in _CPP_HEAD_DIMS and q.stride(-1) == 1
            and q.stride(1) == q.shape[-1] and k_cache.is_contiguous() and v_cache.is_contiguous()
            and cpu.ops() is not None)


_SOFTCAP_ROWS = 256  # query rows per chunk of the written-out softmax (softcap): [H, 256, L] fp32 scores


def _attend_one_featured(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                         seq_len: int, scale: float, window: int, sinks: torch.Tensor | None,
                         softcap: float) -> torch.Tensor:
    """One sequence's rows q [R, H, D] (the last R of its seq_len positions) with a layer's features, over
    the positions its window can see. -> [R, H, D]"""
    R, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    lo = max(0, seq_len - R - window + 1) // block_size * block_size if window else 0
    blocks = table[lo // block_size : triton.cdiv(seq_len, block_size)].long()
    k = k_cache.index_select(0, blocks).flatten(0, 1)[: seq_len - lo]  # [L', KVH, D]
    v = v_cache.index_select(0, blocks).flatten(0, 1)[: seq_len - lo]
    if softcap:  # not expressible in SDPA: the softmax written out, a chunk of rows at a time
        out = torch.empty_like(q)
        for a in range(0, R, _SOFTCAP_ROWS):
            e = min(a + _SOFTCAP_ROWS, R)
            n = k.shape[0] - (R - e)
            out[a:e] = dense_causal_attention_ref(q[a:e], k[:n], v[:n], scale, window=window, sinks=sinks,
                                                  softcap=softcap)
        return out
    L = k.shape[0]
    q_pos = torch.arange(L - R, L, device=q.device)[:, None]
    kv_pos = torch.arange(L, device=q.device)[None, :]
    visible = kv_pos <= q_pos
    if window:
        visible &= kv_pos > q_pos - window
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    mask = visible
    if sinks is not None:  # one more key, all zeros (score 0, value 0), whose additive mask is the sink logit
        zero = k.new_zeros(1, num_kv_heads, 1, head_dim)
        kt, vt = torch.cat([kt, zero], dim=2), torch.cat([vt, zero], dim=2)
        bias = torch.zeros(R, L, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
        mask = torch.cat([bias.expand(num_heads, R, L), sinks.to(q.dtype).view(num_heads, 1, 1).expand(num_heads, R, 1)],
                         dim=2)[None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kt, vt, attn_mask=mask, scale=scale,
                                       enable_gqa=num_heads != num_kv_heads)
    return o[0].transpose(0, 1)


def _paged_attention_featured(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                              scale: float, window: int, sinks: torch.Tensor | None, softcap: float,
                              out: torch.Tensor) -> torch.Tensor:
    use_cpp = _cpp_applies(q, k_cache, v_cache)
    qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    small = [b for b in range(meta.num_seqs) if 1 <= qsl[b + 1] - qsl[b] <= CPP_MAX_QUERY_ROWS] if use_cpp else []
    if small:
        seqs = torch.tensor(small, dtype=torch.long, device=q.device)
        cpu.ops().paged_attention_small_q(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                          seqs, scale, out, meta.batch_invariant, window, sinks, softcap)
    done = set(small)
    for b, seq_len in enumerate(lens):
        if b in done or qsl[b + 1] == qsl[b]:
            continue
        out[qsl[b] : qsl[b + 1]] = _attend_one_featured(q[qsl[b] : qsl[b + 1]], k_cache, v_cache, meta.block_tables[b],
                                                        seq_len, scale, window, sinks, softcap)
    return out


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, *, window: int | None = None,
                        sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Paged attention without Triton (the production CPU path). q: [T, H, D] -> out [T, H, D].

    On CPU in bf16 on AVX512-BF16 every sequence goes to the tiled C++ kernel (`paged_attention_bf16`);
    otherwise, with the C++ kernels built (kernels/cpu.py), sequences with up to `CPP_MAX_QUERY_ROWS`
    query rows go to `paged_attention_small_q` and longer ones to SDPA over gathered blocks; without
    them, pure torch. With `meta.batch_invariant` the C++ kernels take every row (longer runs cut in
    pieces for `paged_attention_small_q`), never splitting a sequence's positions, so a row's output is
    the same whatever else the step holds; the torch path makes no such promise. A layer's features
    (`window`, `sinks`, `softcap`) take the path of the module docstring."""
    _check(q, k_cache, v_cache, meta)
    window, sinks, softcap = check_features(q, window, sinks, softcap)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    use_cpp = _cpp_applies(q, k_cache, v_cache)
    tiled = use_cpp and q.dtype == torch.bfloat16 and cpu.compiled_isa() == "avx512_bf16"
    if sinks is not None or softcap or (window and not tiled):  # the tiled kernel takes a window alone
        return _paged_attention_featured(q, k_cache, v_cache, meta, scale, window, sinks, softcap, out)
    plan = _cpu_plan(meta, k_cache.shape[1], use_cpp, tiled)
    invariant = meta.batch_invariant
    if plan.use_cpp and plan.small_seqs.numel():
        cpu.ops().paged_attention_small_q(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                          meta.block_tables, plan.small_seqs, scale, out, invariant)
    if plan.pieces is not None and plan.pieces[3].numel():
        cpu.ops().paged_attention_small_q(q, k_cache, v_cache, *plan.pieces, scale, out, True)
    if plan.tiled_seqs is not None and plan.tiled_seqs.numel():
        cpu.ops().paged_attention_bf16(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                          meta.block_tables, plan.tiled_seqs, scale, out, invariant, window)
    for part in plan.decode:
        num_seqs = part.rows.shape[0]
        q_dec = q if part.in_order else q.index_select(0, part.rows)
        if q.dtype == torch.float32 and num_kv_heads <= _BLOCK_DIAG_MAX_KV_HEADS:
            o = _decode_block_diag(q_dec, k_cache, v_cache, part, scale)
        else:
            # The GQA group's heads become the query length: one [group, L] score matrix per kv head.
            o = F.scaled_dot_product_attention(
                q_dec.reshape(num_seqs, num_kv_heads, group, head_dim), _gather(k_cache, part),
                _gather(v_cache, part), attn_mask=None if part.equal_len is not None else part.mask, scale=scale)
        if part.in_order:  # the whole batch is this one decode group: the output is o itself
            return o.reshape(num_seqs, num_heads, head_dim)
        out.index_copy_(0, part.rows, o.reshape(num_seqs, num_heads, head_dim))
    if (part := plan.prefill) is not None:
        num_seqs = part.blocks.shape[0]
        q_pre = q.index_select(0, part.q_index).view(num_seqs, part.max_q, num_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q_pre, _gather(k_cache, part), _gather(v_cache, part),
                                           attn_mask=part.mask, scale=scale, enable_gqa=group > 1)
        o = o.transpose(1, 2).reshape(num_seqs * part.max_q, num_heads, head_dim)
        out.index_copy_(0, part.rows, o.index_select(0, part.out_index))
    for part, start, end, fresh in plan.prefill_each or ():
        # a fresh prompt's row i sits at position i: SDPA's causal mask (keys past the prompt, the
        # block's padding, are then never visible) instead of an explicit one
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], _gather(k_cache, part),
                                           _gather(v_cache, part), attn_mask=None if fresh else part.mask,
                                           is_causal=fresh, scale=scale, enable_gqa=group > 1)
        out[start:end] = o[0].transpose(0, 1)
    return out
