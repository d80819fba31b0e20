"""paged_attention: Triton kernel (interpreted), the CPU path (C++ kernel for few-row sequences, SDPA
for prefill) and the pure-torch path against dense causal attention in fp32."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrt.kernels import (
    cpu,
    paged_attention_cpu,
    paged_attention_triton,
)
from agentrt.kernels.paged_attention import _auto_num_splits
from agentrt.kernels.paged_attention_cpu import CPP_MAX_QUERY_ROWS
from tests.paged_batch import ATOL, check_rule, make_paged_batch

# (query lengths, sequence lengths): decode rows, prefill chunks over cached context, fresh prefill;
# lengths deliberately not multiples of the block size.
MIXED = ([1, 5, 1, 20], [33, 17, 70, 40])
PREFILL = ([37, 23], [37, 61])
DECODE = ([1, 1, 1], [1, 45, 64])
DECODE_EQUAL = ([1, 1, 1], [45, 45, 45])  # torch path: no mask, no padding (slots past 45 are NaN)
DECODE_ONE = ([1], [37])
DECODE_SPREAD = ([1, 1, 1, 1, 1, 2], [3, 300, 40, 620, 290, 45])  # torch path: 3 decode groups + prefill
PREFILL_RAGGED = ([60, 3, 40, 1], [60, 80, 75, 9])  # torch path: SDPA per prefill sequence (fresh and not)
SCENARIOS = {"mixed": MIXED, "prefill": PREFILL, "decode": DECODE, "decode_equal": DECODE_EQUAL,
             "decode_one": DECODE_ONE, "decode_spread": DECODE_SPREAD, "prefill_ragged": PREFILL_RAGGED}
GQA = [(4, 4), (9, 3), (8, 1)]  # (num_heads, num_kv_heads): ratios 1, 3, 8
@pytest.fixture(params=[True, False], ids=["cpp", "torch"])
def cpu_kernels(request):
    """The CPU path with the C++ kernel (when it builds here) and without it."""
    if request.param and not cpu.available():
        pytest.skip("C++ CPU kernels cannot be built here")
    with cpu.use_cpu_kernels(request.param):
        yield request.param


@pytest.fixture
def torch_only():
    with cpu.use_cpu_kernels(False):
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_torch_path_matches_dense(paged_batch, cpu_kernels, scenario, heads, block_size, dtype):
    batch = paged_batch(*SCENARIOS[scenario], *heads, 64, block_size, dtype)
    scale = 64 ** -0.5
    out = paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)
    assert not out.isnan().any()
    gold = batch.dense(scale)
    same_dtype_dense = batch.dense(scale, dtype)  # fp32 math, output rounded to dtype
    err = (out.float() - gold).abs().max().item()
    err_rounding = (same_dtype_dense.float() - gold).abs().max().item()
    assert err <= 4 * err_rounding + ATOL[dtype], f"err {err:.3g} vs rounding {err_rounding:.3g}"


def test_torch_path_caches_its_plan(paged_batch, cpu_kernels):
    batch = paged_batch(*MIXED, 9, 3, 64, 16, torch.float32)
    first = paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    plan = batch.meta._cpu_plan
    assert plan is not None and plan.prefill is not None and plan.use_cpp == cpu_kernels
    if cpu_kernels:  # the rows of 1 and 5 queries: C++; 20 rows: SDPA
        assert plan.small_seqs.tolist() == [0, 1, 2] and not plan.decode
    else:
        assert plan.decode
    second = paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    assert batch.meta._cpu_plan is plan
    assert torch.equal(first, second)


@pytest.mark.parametrize(("scenario", "equal_len", "in_order"), [
    ("mixed", None, False), ("decode", None, True), ("decode_equal", 45, True), ("decode_one", 37, True)])
def test_torch_path_decode_plan(paged_batch, torch_only, scenario, equal_len, in_order):
    """Decode-only batches skip the row gather/scatter; equal lengths skip the mask and padding."""
    batch = paged_batch(*SCENARIOS[scenario], 9, 3, 64, 16, torch.float32)
    paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    (part,) = batch.meta._cpu_plan.decode
    assert (part.equal_len, part.in_order) == (equal_len, in_order)


def test_torch_path_prefill_per_sequence_when_padding_would_double_the_work(paged_batch, torch_only):
    batch = paged_batch(*PREFILL_RAGGED, 9, 3, 64, 16, torch.float32)
    out = paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    plan = batch.meta._cpu_plan
    assert plan.prefill is None and [(a, b, fresh) for _, a, b, fresh in plan.prefill_each] == [
        (0, 60, True), (60, 63, False), (63, 103, False)]
    torch.testing.assert_close(out, batch.dense(0.125), rtol=1e-5, atol=1e-5)


def test_torch_path_groups_decode_rows_by_length(paged_batch, torch_only):
    batch = paged_batch(*DECODE_SPREAD, 9, 3, 64, 16, torch.float32)
    paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    groups = batch.meta._cpu_plan.decode
    lens = DECODE_SPREAD[1]
    got = sorted(sorted(lens[int(r)] for r in g.rows) for g in groups)  # rows == sequence index here
    assert got == [[3, 40], [290, 300], [620]]
    assert not any(g.in_order for g in groups)


def test_torch_path_empty_batch(paged_batch, cpu_kernels):
    batch = paged_batch(*DECODE, 4, 4, 64, 16, torch.float32)
    q = batch.q[:0]
    meta = type(batch.meta)(batch.meta.query_start_loc[:1], batch.meta.seq_lens[:0], batch.meta.block_tables[:0], 0, 0)
    assert paged_attention_cpu(q, batch.k_cache, batch.v_cache, meta, 0.125).shape == (0, 4, 64)
    assert paged_attention_triton(q, batch.k_cache, batch.v_cache, meta, 0.125).shape == (0, 4, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_triton_matches_dense(paged_batch, scenario, heads, block_size, dtype):
    batch = paged_batch(*SCENARIOS[scenario], *heads, 64, block_size, dtype)
    scale = 64 ** -0.5
    out = paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, num_splits=1)
    check_rule(out, batch, scale)


@pytest.mark.parametrize(("dtype", "head_dim", "heads"), [
    (torch.bfloat16, 64, (9, 3)),
    (torch.float16, 128, (8, 2)),
])
def test_triton_other_dtypes_and_head_dims(paged_batch, dtype, head_dim, heads):
    batch = paged_batch(*MIXED, *heads, head_dim, 16, dtype, seed=1)
    scale = head_dim ** -0.5
    out = paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, num_splits=1)
    check_rule(out, batch, scale)


def test_triton_strided_query(paged_batch):
    """q as a view of a fused qkv output (row stride larger than H * D)."""
    batch = paged_batch(*MIXED, 9, 3, 64, 16, torch.float32, seed=2)
    fused = torch.cat([batch.q.flatten(1), torch.randn(batch.q.shape[0], 2 * 3 * 64)], dim=1)
    q = fused[:, :9 * 64].view(-1, 9, 64)
    assert not q.is_contiguous()
    out = paged_attention_triton(q, batch.k_cache, batch.v_cache, batch.meta, 0.125, num_splits=1)
    check_rule(out, batch, 0.125)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_split_k_decode(paged_batch, heads, num_splits, dtype):
    batch = paged_batch(*DECODE, *heads, 64, 16, dtype, seed=3)
    scale = 64 ** -0.5
    out = paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, num_splits=num_splits)
    check_rule(out, batch, scale)


def test_triton_split_k_mixed_batch(paged_batch):
    """Forced split-K on prefill rows: some slices see no key of some rows and must weigh zero."""
    batch = paged_batch(*MIXED, 9, 3, 64, 16, torch.float32, seed=4)
    out = paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, num_splits=3)
    check_rule(out, batch, 0.125)


def test_auto_split_k_long_decode(paged_batch):
    batch = paged_batch([1, 1], [1100, 700], 8, 1, 64, 32, torch.float32, seed=5)
    assert _auto_num_splits(batch.meta, 1, batch.q.device) > 1
    out = paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    check_rule(out, batch, 0.125)


def test_auto_split_k_choice(paged_batch):
    cpu = torch.device("cpu")
    prefill = paged_batch([1, 30], [1100, 40], 4, 4, 64, 32, torch.float32)
    assert _auto_num_splits(prefill.meta, 4, cpu) == 1  # not decode-only
    short = paged_batch([1, 1], [100, 40], 4, 4, 64, 32, torch.float32)
    assert _auto_num_splits(short.meta, 4, cpu) == 1  # contexts too short
    long = paged_batch([1], [2048], 4, 4, 64, 32, torch.float32)
    assert _auto_num_splits(long.meta, 64, cpu) == 1  # enough programs without splitting
    assert 1 < _auto_num_splits(long.meta, 1, cpu) <= 2048 // 256


@st.composite
def batches(draw):
    num_seqs = draw(st.integers(1, 5))
    seq_lens = draw(st.lists(st.integers(1, 80), min_size=num_seqs, max_size=num_seqs))
    q_lens = [draw(st.integers(0, s)) for s in seq_lens]
    heads = draw(st.sampled_from(GQA))
    block_size = draw(st.sampled_from([4, 16, 32]))
    return q_lens, seq_lens, heads, block_size, draw(st.integers(0, 2**16))


@settings(max_examples=40, deadline=None)
@given(batches(), st.booleans())
def test_torch_path_property(case, use_cpp):
    """Any batch (including sequences with no new rows) matches dense attention on the CPU path,
    with and without the C++ kernel."""
    q_lens, seq_lens, heads, block_size, seed = case
    batch = make_paged_batch(q_lens, seq_lens, *heads, 64, block_size, torch.float32, seed=seed)
    with cpu.use_cpu_kernels(use_cpp):
        out = paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    torch.testing.assert_close(out, batch.dense(0.125), rtol=1e-5, atol=1e-5)


needs_cpp = pytest.mark.skipif(not cpu.available(), reason="C++ CPU kernels cannot be built here")


@needs_cpp
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("heads", GQA)
def test_cpp_kernel_query_rows_and_head_dims(paged_batch, head_dim, heads):
    """1 to CPP_MAX_QUERY_ROWS query rows per sequence (decode, draft verification), every supported
    head dim, contexts not a multiple of the block size; prefill rows beyond go to SDPA."""
    q_lens = [1, 2, 7, CPP_MAX_QUERY_ROWS, CPP_MAX_QUERY_ROWS + 1]
    batch = paged_batch(q_lens, [1, 19, 50, 33, 81], *heads, head_dim, 16, torch.float32, seed=3)
    scale = head_dim ** -0.5
    out = paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)
    assert batch.meta._cpu_plan.small_seqs.tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(out, batch.dense(scale), rtol=1e-5, atol=1e-5)


@needs_cpp
@pytest.mark.parametrize("num_seqs", [1, 2, 9])  # fewer sequences than threads: work split by kv head
def test_cpp_kernel_strided_query_and_thread_split(paged_batch, num_seqs):
    """q as the model hands it over: a view of a wider [T, H + KVH, D] tensor (row stride > H * D)."""
    lens = [5 + 37 * i for i in range(num_seqs)]
    batch = paged_batch([1] * num_seqs, lens, 9, 3, 64, 16, torch.float32, seed=num_seqs)
    wide = torch.randn(num_seqs, 12, 64)
    wide[:, :9] = batch.q
    out = paged_attention_cpu(wide[:, :9], batch.k_cache, batch.v_cache, batch.meta, 0.125)
    torch.testing.assert_close(out, batch.dense(0.125), rtol=1e-5, atol=1e-5)


@needs_cpp
def test_cpp_kernel_rejects_bad_input(paged_batch):
    batch = paged_batch(*DECODE, 9, 3, 64, 16, torch.float32)
    m, ops = batch.meta, cpu.ops()
    out = torch.empty_like(batch.q)
    seqs = torch.arange(3)
    with pytest.raises(RuntimeError, match="fp32"):
        ops.paged_attention_small_q(batch.q.double(), batch.k_cache, batch.v_cache, m.query_start_loc, m.seq_lens,
                                    m.block_tables, seqs, 0.125, out)
    with pytest.raises(RuntimeError, match="int32 metadata"):
        ops.paged_attention_small_q(batch.q, batch.k_cache, batch.v_cache, m.query_start_loc.long(), m.seq_lens,
                                    m.block_tables, seqs, 0.125, out)
    too_long = m.seq_lens.clone()
    too_long[1] = 10_000  # more positions than its block table holds
    with pytest.raises(RuntimeError, match="sequence 1"):
        ops.paged_attention_small_q(batch.q, batch.k_cache, batch.v_cache, m.query_start_loc, too_long,
                                    m.block_tables, seqs, 0.125, out)


def test_triton_sequence_without_new_rows(paged_batch):
    batch = paged_batch([3, 0, 1], [20, 9, 40], 9, 3, 64, 16, torch.float32, seed=6)
    for num_splits in (1, 2):
        out = paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, num_splits=num_splits)
        check_rule(out, batch, 0.125)
