"""Mixture-of-experts kernels: the grouped expert projection (C++ on every CPU kind, the torch paths) against a
float64 reference over irregular groupings (odd row counts, experts without rows, first and last
included, odd K, N off the panel width), routing and grouping exactly, MXFP4 widening against
transformers' own."""

import pytest
import torch

from agentrt.kernels import cpu
from agentrt.kernels.moe import (
    ExpertPackCache,
    grouped_linear,
    grouped_linear_ref,
    grouped_linear_torch,
    grouped_mm_applies,
    grouped_mm_linear,
    route_topk,
    sort_by_expert,
)

# (rows per expert, K, N): empty experts at either end and inside; rows past the 6-row tiles and the 16-row
# widening threshold; K odd (bf16 pairs with a zero), N off the 16- and 32-column panels
GROUPS = [
    ((0, 3, 0, 1, 5), 29, 37),
    ((7, 0, 0, 17, 1, 0), 64, 32),
    ((1,), 96, 40),
    ((0, 0, 2), 33, 8),
    ((0, 0, 0), 16, 16),  # no rows at all
]


def _case(counts, k, n, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed + sum(counts) * 31 + k)
    e = len(counts)
    offsets = torch.tensor([0, *counts]).cumsum(0)
    x = torch.randn(int(offsets[-1]), k, generator=gen).to(dtype)
    w = (torch.randn(e, n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(e, n, generator=gen).to(dtype) if bias else None
    return x, offsets, w, b


def _max_error(out, ref):
    return (out.double() - ref).abs().max().item() if out.numel() else 0.0


def _torch_same_dtype_error(x, offsets, w, b, ref):
    """How far torch's own GEMM in x's dtype lands from the float64 reference (the bound's yardstick)."""
    return _max_error(grouped_linear_torch(x, offsets, w, b), ref)


@pytest.mark.parametrize(("counts", "k", "n"), GROUPS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_grouped_linear_matches_reference(cpu_kind, counts, k, n, bias, dtype):
    x, offsets, w, b = _case(counts, k, n, dtype, bias)
    cache = ExpertPackCache()
    with torch.inference_mode():
        out = grouped_linear(x, offsets, w, b, cache)
    assert cache.packed is not None and cache.packed.shape[0] == len(counts)  # the C++ path ran
    assert out.shape == (x.shape[0], n) and out.dtype == dtype
    ref = grouped_linear_ref(x, offsets, w, b)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    else:  # flash-attention's rule: within twice torch's own bf16 error
        assert _max_error(out, ref) <= 2 * _torch_same_dtype_error(x, offsets, w, b, ref) + 1e-2


@pytest.mark.parametrize(("counts", "k", "n"), GROUPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_paths_match_reference(counts, k, n, dtype):
    x, offsets, w, b = _case(counts, k, n, dtype, bias=True, seed=1)
    ref = grouped_linear_ref(x, offsets, w, b)
    with cpu.use_cpu_kernels(False):
        out = grouped_linear(x, offsets, w, b, ExpertPackCache())
    tol = 1e-5 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    if grouped_mm_applies(x, w):  # the one-launch path the GPU takes in bf16 (torch runs it on CPU too)
        torch.testing.assert_close(grouped_mm_linear(x, offsets, w, b).double(), ref, rtol=tol, atol=tol)


def test_a_row_is_what_its_expert_alone_gives(cpu_kind):
    """Grouping changes nothing for a row: each expert's rows equal that expert's weight over those rows alone
    (the packed linear kernel), bit for bit."""
    from agentrt.kernels.linear import PackCache, linear

    x, offsets, w, _ = _case((3, 0, 9, 2), 48, 40, torch.bfloat16, bias=False, seed=2)
    with torch.inference_mode():
        out = grouped_linear(x, offsets, w, None, ExpertPackCache())
        for e in range(w.shape[0]):
            r0, r1 = int(offsets[e]), int(offsets[e + 1])
            if r1 > r0:
                assert torch.equal(out[r0:r1], linear(x[r0:r1], w[e], None, PackCache(), batch_invariant=True))


def test_route_topk_softmax_and_renormalization():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 5.0, 1.0]])
    probs = logits.softmax(-1)
    weights, ids = route_topk(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [2, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    renorm, ids2 = route_topk(logits, 2, renormalize=True)
    assert torch.equal(ids2, ids)
    torch.testing.assert_close(renorm, weights / weights.sum(-1, keepdim=True))
    oss, ids3 = route_topk(logits, 2, renormalize=False, softmax_after_topk=True)  # gpt-oss: softmax of the top k
    assert torch.equal(ids3, ids)
    torch.testing.assert_close(oss, renorm)
    with pytest.raises(ValueError, match="top_k 5 .* 4 experts"):
        route_topk(logits, 5, renormalize=True)


def test_sort_by_expert_groups_stably():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # flat: 2 0 2 3 0 2
    order, offsets = sort_by_expert(ids, 5)
    assert offsets.tolist() == [0, 2, 2, 5, 6, 6]  # expert 1 and 4 empty
    assert order.tolist() == [1, 4, 0, 2, 5, 3]  # within an expert, token order
    assert (order // 2).tolist() == [0, 2, 0, 1, 2, 1]


def test_grouped_linear_rejects_bad_shapes():
    x, offsets, w, b = _case((2, 1), 8, 4, torch.float32, bias=True)
    with pytest.raises(ValueError, match=r"offsets \[E \+ 1\] = \[3\]"):
        grouped_linear(x, offsets[:-1], w, b)
    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[E, N, K\]"):
        grouped_linear(x[:, :5], offsets, w, b)
    with pytest.raises(ValueError, match=r"bias \[E, N\]"):
        grouped_linear(x, offsets, w, b[:, :2])
    if cpu.available():
        with torch.inference_mode(), pytest.raises(RuntimeError, match="offsets run from 0 to the 3 rows"):
            grouped_linear(x, torch.tensor([0, 2, 2]), w, b, ExpertPackCache())


def test_mxfp4_widening_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from agentrt.engine.moe import dequantize_mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=gen, dtype=torch.uint8)  # [E, rows, groups, 16]
    scales = torch.randint(117, 135, (3, 8, 2), generator=gen, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)  # [E, rows, 64]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, 64, rows]: x @ W's layout
    assert torch.equal(ours, theirs.transpose(1, 2))
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        dequantize_mxfp4(blocks, scales[..., :1])
