"""Batch invariance of the C++ CPU kernels (the engine's deterministic mode): with `batch_invariant`, a row's
output is bit-identical whatever else the call holds: how many rows share a projection, and for attention
which other sequences share the step, how a sequence's query rows are cut into runs (prefill chunks, a
prefix-cache hit leaving one row, decode), for every CPU kind this machine builds."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrt.kernels import build_attention_metadata, cpu
from agentrt.kernels.linear import PackCache, linear
from agentrt.kernels.paged_attention_cpu import paged_attention_cpu
from tests.paged_batch import make_paged_batch

pytestmark = pytest.mark.skipif(not cpu.available(), reason="C++ CPU kernels cannot be built here")
KINDS = cpu.supported_kinds() if cpu.available() else ()
DTYPES = [torch.float32, torch.bfloat16]
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(data=st.data())
def test_projection_rows_do_not_depend_on_the_row_count(kind, dtype, data):
    n = data.draw(st.sampled_from([32, 48, 96]), label="N")
    k = data.draw(st.sampled_from([64, 96, 130]), label="K")
    counts = data.draw(st.lists(st.integers(1, 140), min_size=2, max_size=4), label="row counts")
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(max(counts), k, generator=gen).to(dtype)
    pack = PackCache()
    with cpu.use_kind(kind), torch.inference_mode():
        ref = linear(x[:1], w, bias, pack, batch_invariant=True)[0]
        outs = [linear(x[:m], w, bias, pack, batch_invariant=True) for m in counts]
    for m, out in zip(counts, outs, strict=True):
        assert torch.equal(out[0], ref), f"row 0 differs in a call of {m} rows"
    for a, b in zip(outs, outs[1:]):
        common = min(a.shape[0], b.shape[0])
        assert torch.equal(a[:common], b[:common])


def _runs(rows: int, cuts: list[int]) -> list[tuple[int, int]]:
    edges = sorted({0, rows, *[c for c in cuts if 0 < c < rows]})
    return list(zip(edges, edges[1:]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 37])
@SETTINGS
@given(data=st.data())
def test_attention_rows_do_not_depend_on_neighbours_or_cuts(kind, dtype, window, data):
    """A target sequence of R query rows at L positions, computed whole in one batch and as runs of rows
    (each run a sequence whose seq_len ends at its last row) among other random sequences: every row of
    the target is bit-identical, decode-sized runs (one row) included. A sliding window too where the tiled
    bf16 kernel takes it (elsewhere a windowed prefill run goes to SDPA, which promises no invariance)."""
    with cpu.use_kind(kind):
        tiled = dtype == torch.bfloat16 and cpu.compiled_isa() == "avx512_bf16"
    if window and not tiled:
        pytest.skip("a windowed layer is batch-invariant on the tiled bf16 kernel only")
    block_size = data.draw(st.sampled_from([4, 16]), label="block size")
    L = data.draw(st.integers(2, 150), label="positions")
    R = data.draw(st.integers(1, min(L, 70)), label="query rows")
    cuts = data.draw(st.lists(st.integers(1, max(1, R - 1)), max_size=4), label="cuts")
    others = data.draw(st.lists(st.tuples(st.integers(1, 20), st.integers(0, 60)), max_size=5), label="others")
    H, KVH, D = 6, 2, 64
    # the cache: the target first, then the others (q rows / extra positions of each)
    q_lens = [R] + [q for q, _ in others]
    seq_lens = [L] + [q + extra for q, extra in others]
    batch = make_paged_batch(q_lens, seq_lens, H, KVH, D, block_size, dtype, seed=L * 131 + R)
    tables = batch.meta.block_tables
    scale = D ** -0.5
    target_q = batch.q[:R]

    def attend(seqs: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
        """seqs: (q rows, seq_len, cache row of its block table) -> out rows, in order."""
        qsl = [0]
        for q, _, _ in seqs:
            qsl.append(qsl[-1] + q.shape[0])
        lens = [n for _, n, _ in seqs]
        meta = build_attention_metadata(torch.tensor(qsl), torch.tensor(lens),
                                        tables[torch.tensor([b for _, _, b in seqs])],
                                        max(q.shape[0] for q, _, _ in seqs), max(lens), batch_invariant=True)
        q = torch.cat([q for q, _, _ in seqs])
        with cpu.use_kind(kind):
            return paged_attention_cpu(q, batch.k_cache, batch.v_cache, meta, scale, window=window)

    rest = [(batch.q[batch.query_start_loc[i]:batch.query_start_loc[i + 1]], seq_lens[i], i)
            for i in range(1, len(q_lens))]
    whole = attend([(target_q, L, 0)])[:R]
    with_others = attend(rest + [(target_q, L, 0)])[-R:]
    assert torch.equal(with_others, whole)
    pieces = []
    for i, (a, e) in enumerate(_runs(R, cuts)):
        run = (target_q[a:e], L - R + e, 0)
        out = attend([run] + rest if i % 2 else rest + [run])
        pieces.append(out[: e - a] if i % 2 else out[out.shape[0] - (e - a):])
    assert torch.equal(torch.cat(pieces), whole)
    lone_last = attend([(target_q[R - 1:], L, 0)])  # a decode row, alone
    assert torch.equal(lone_last[0], whole[R - 1])
