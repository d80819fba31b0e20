"""The sampler's row kernels (kernels/csrc/sampler.h) on every CPU kind this machine supports.

topk_rows against torch's stable descending sort cut to k: the same values as torch.topk (a NaN
first), and among equal values the lower index first, the order topk_rows promises.
logsumexp_rows against torch.logsumexp in fp64.
penalize_rows against engine/sampling.py's numpy path, bit for bit.
"""

import math

import pytest
import torch

from agentrt.kernels import cpu


def reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    vals, idx = x.sort(dim=-1, descending=True, stable=True)
    return vals[:, :k], idx[:, :k]


def check(x: torch.Tensor, k: int) -> None:
    vals, idx = cpu.ops().topk_rows(x, k)
    want_vals, want_idx = reference(x, k)
    assert vals.dtype == torch.float32 and idx.dtype == torch.int64 and vals.shape == idx.shape == (x.shape[0], k)
    assert torch.equal(idx, want_idx), (x.shape, k)
    assert torch.equal(vals.isnan(), want_vals.isnan())
    assert torch.equal(vals.nan_to_num(), want_vals.nan_to_num())
    torch_vals = x.topk(k, dim=-1).values  # torch.topk: the same values, in the same order
    assert torch.equal(vals.nan_to_num(), torch_vals.nan_to_num())


@pytest.mark.parametrize(("vocab", "k"), [(v, k) for v in (1, 7, 8, 9, 33, 300, 49152) for k in (1, 5, 64, 256) if k <= v])
def test_random_rows(cpu_kind, vocab, k):
    g = torch.Generator().manual_seed(vocab * 1000 + k)
    x = torch.randn(3, vocab, generator=g) * 3
    x[2] = x[2] ** 3  # heavy tails, as logits have
    check(x, k)
    check(x, vocab)  # everything, sorted


@pytest.mark.parametrize("order", ["ascending", "descending", "sawtooth"])
def test_orders_that_defeat_the_bound(cpu_kind, order):
    # ascending: every entry beats the k-th kept so far, so the buffer is cut again and again
    v = torch.arange(5000, dtype=torch.float32)
    row = {"ascending": v, "descending": v.flip(0), "sawtooth": v % 97 + v / 10000}[order]
    for k in (1, 3, 200, 1500):
        check(row.unsqueeze(0).contiguous(), k)


def test_ties_rank_by_index(cpu_kind):
    const = torch.zeros(2, 1000)
    check(const, 10)
    assert cpu.ops().topk_rows(const, 4)[1].tolist() == [[0, 1, 2, 3]] * 2
    x = torch.randint(0, 4, (4, 2000), generator=torch.Generator().manual_seed(1)).float()  # many equal values
    for k in (1, 7, 600, 1999):
        check(x, k)
    zeros = torch.tensor([[0.0, -0.0, 1.0, -0.0, 0.0]])  # -0 equals +0
    assert cpu.ops().topk_rows(zeros, 5)[1].tolist() == [[2, 0, 1, 3, 4]]


def test_nan_and_infinities(cpu_kind):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 700, generator=g)
    x[0, [5, 300, 699]] = math.nan  # NaNs rank first, lowest index first
    x[1, :] = -math.inf
    x[1, 650] = 1.0
    x[2, ::3] = math.inf
    x[3, :] = math.nan  # all NaN: the first k
    for k in (1, 2, 3, 4, 50, 700):
        check(x, k)
    vals, idx = cpu.ops().topk_rows(x, 4)
    assert idx[0, :3].tolist() == [5, 300, 699] and idx[3].tolist() == [0, 1, 2, 3]
    assert idx[1, 0].item() == 650 and math.isinf(vals[1, 1].item())


def test_rejects_bad_input(cpu_kind):
    ops = cpu.ops()
    x = torch.randn(2, 10)
    for bad_k in (0, -1, 11):
        with pytest.raises(RuntimeError, match=f"k must be in \\[1, 10\\], got {bad_k}"):
            ops.topk_rows(x, bad_k)
    for bad in (x.double(), x.bfloat16(), x.t(), x[0]):
        with pytest.raises(RuntimeError, match="topk_rows: x \\[R, V\\] contiguous fp32"):
            ops.topk_rows(bad, 1)


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 300, 49152])
def test_logsumexp_rows(cpu_kind, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(4, vocab, generator=g) * 4
    x[1] *= 30  # one dominant entry, and exponents far below exp's range
    x[2, ::2] = -math.inf  # masked entries
    x[3] = x[3] + 1e4  # large offsets: the maximum comes out first
    out = cpu.ops().logsumexp_rows(x)
    want = x.double().logsumexp(dim=-1)
    assert out.dtype == torch.float32 and out.shape == (4,)
    finite = want.isfinite()  # with vocab 1 the masked row is all -inf
    assert torch.equal(out.double()[~finite], want[~finite])
    out, want = out.double()[finite], want[finite]
    err = (out - want).abs()
    assert (err <= 2e-6 * want.abs().clamp(min=1)).all(), err.max().item()
    err_torch = (x.logsumexp(dim=-1).double()[finite] - want).abs()
    assert (err <= 2 * err_torch + 2e-6 * want.abs().clamp(min=1)).all()


def test_logsumexp_rows_special_values(cpu_kind):
    inf, nan = math.inf, math.nan
    x = torch.tensor([[-inf, -inf, -inf], [1.0, inf, 2.0], [0.0, nan, 1.0], [-inf, 0.0, -inf], [-inf, inf, nan]])
    out = cpu.ops().logsumexp_rows(x)
    want = x.logsumexp(dim=-1)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num()), (out, want)
    for bad in (x.double(), x.t(), x[0], torch.empty(2, 0)):
        with pytest.raises(RuntimeError, match="logsumexp_rows: x \\[R, V\\] contiguous fp32, V >= 1"):
            cpu.ops().logsumexp_rows(bad)



# ---- penalize_rows: the penalties in C++ against engine/sampling.py's numpy path, bit for bit ----------


def _penalty_batch(seed: int, vocab: int):
    """Rows of logits with specials (0, -0, +-inf), histories with repeats, ids past the vocabulary
    (both paths clip them) and prompt-only rows, and every kind of penalty mixed across the rows."""
    from agentrt.engine import SamplingParams
    from agentrt.engine.sampling import RowContext

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(7, vocab, generator=g) * 4
    logits[0, :4] = torch.tensor([0.0, -0.0, math.inf, -math.inf])
    params = [SamplingParams(repetition_penalty=1.7), SamplingParams(repetition_penalty=0.6, presence_penalty=0.3),
              SamplingParams(frequency_penalty=0.9), SamplingParams(presence_penalty=-1.2),
              SamplingParams(frequency_penalty=-0.5, presence_penalty=1.5, repetition_penalty=1.3),
              SamplingParams(frequency_penalty=2.0)]
    rows = [0, 2, 3, 4, 5, 6]  # row 1 uses nothing and must stay as it is
    contexts = []
    for i in range(len(rows)):
        n_prompt = int(torch.randint(1, 60, (1,), generator=g))
        n_out = 0 if i == 3 else int(torch.randint(1, 300, (1,), generator=g))
        prompt = torch.randint(0, vocab, (n_prompt,), generator=g)
        output = torch.randint(0, min(vocab, 24), (n_out,), generator=g)  # many repeats
        ids = torch.cat([prompt, output])
        if i == 0:
            ids[:4] = torch.tensor([0, 1, 2, 3])  # the specials of row 0
            ids[-1] = vocab + 5  # past the vocabulary
        contexts.append(RowContext(ids, n_prompt, []))
    return logits, params, contexts, rows


@pytest.mark.parametrize("vocab", [40, 300, 49152])
@pytest.mark.parametrize("seed", [0, 1])
def test_penalize_rows_equals_the_numpy_path(cpu_kind, monkeypatch, vocab, seed):
    import agentrt.engine.sampling as sampling

    logits, params, contexts, rows = _penalty_batch(seed, vocab)
    fast, slow = logits.clone(), logits.clone()
    sampling.apply_penalties(fast, params, contexts, rows)
    with monkeypatch.context() as m:
        m.setattr(sampling, "_row_ops", lambda x: None)  # the numpy path
        sampling.apply_penalties(slow, params, contexts, rows)
    assert not torch.equal(fast, logits)  # something was penalized
    assert torch.equal(fast[1], logits[1])
    assert torch.equal(fast.isnan(), slow.isnan())
    assert torch.equal(fast.view(torch.int32), slow.view(torch.int32))  # the same bits, -0 included


def test_penalize_rows_rejects_bad_input(cpu_kind):
    ops = cpu.ops()
    h = [torch.tensor([1, 2, 3])]
    with pytest.raises(RuntimeError, match="fp32"):
        ops.penalize_rows(torch.zeros(2, 8, dtype=torch.float64), [0], h, [1], [1.1], [0.0], [0.0])
    with pytest.raises(RuntimeError, match="row 2 outside"):
        ops.penalize_rows(torch.zeros(2, 8), [2], h, [1], [1.1], [0.0], [0.0])
    with pytest.raises(RuntimeError, match="one history"):
        ops.penalize_rows(torch.zeros(2, 8), [0, 1], h, [1], [1.1], [0.0], [0.0])
    with pytest.raises(RuntimeError, match="int64"):
        ops.penalize_rows(torch.zeros(2, 8), [0], [torch.tensor([1.0])], [1], [1.1], [0.0], [0.0])
