"""kernels.moe.grouped_quant_linear: a mixture's experts kept in block formats (Q8_0 / Q4_1 of `--quantization
int8|int4`, gpt-oss's MXFP4), every row bit for bit what `quant_linear` gives it with its expert's weight, on every
CPU kind (AVX2 forced included), fp32 and bf16, over irregular groupings (experts without rows first, last and
inside; 1-4 rows per expert (the blockwise path) and more (the tiles, MXFP4's AMX passes); N off the 4- and 16-row
groups); against
the float64 reference; without the C++ kernels; MXFP4 from the checkpoint's OCP layout decoding to the values
transformers' layout stands for; bad input named."""

import pytest
import torch

from agentrt.kernels import cpu
from agentrt.kernels.moe import grouped_quant_linear, grouped_quant_linear_ref
from agentrt.kernels.quant import (TYPE_IDS, QuantExperts, QuantWeight, dequantize_ref, mxfp4_from_ocp, quant_linear,
                                  quantize_experts)

# (rows per expert, K, N)
GROUPS = [
    ((0, 3, 0, 1, 5), 64, 37),
    ((7, 0, 0, 17, 1, 0), 96, 32),
    ((1,), 32, 40),
    ((0, 0, 2, 4), 160, 9),
    ((0, 0, 0), 32, 16),  # no rows at all
    ((70, 0, 2), 64, 20),  # more rows than one pass of MXFP4's AMX tiles (64)
]
FORMATS = ["Q8_0", "Q4_1", "MXFP4"]


def make_experts(name: str, e: int, n: int, k: int, seed: int) -> QuantExperts:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=gen) / k**0.5
    if name != "MXFP4":
        return quantize_experts(w, name)
    from agentrt.engine.testing import quantize_mxfp4

    blocks, scales = quantize_mxfp4(w)
    return QuantExperts(mxfp4_from_ocp(blocks, scales), TYPE_IDS["MXFP4"], (e, n, k))


def _case(name, counts, k, n, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed + sum(counts) * 31 + k)
    offsets = torch.tensor([0, *counts]).cumsum(0)
    x = torch.randn(int(offsets[-1]), k, generator=gen).to(dtype)
    b = torch.randn(len(counts), n, generator=gen) if bias else None
    return x, offsets, make_experts(name, len(counts), n, k, seed), b


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(("counts", "k", "n"), GROUPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_equal_quant_linear_of_their_expert(cpu_kind, name, counts, k, n, dtype):
    x, offsets, w, b = _case(name, counts, k, n, dtype, bias=len(counts) % 2 == 1)
    out = grouped_quant_linear(x, offsets, w, b)
    assert out.shape == (x.shape[0], n) and out.dtype == dtype
    for e, (r0, r1) in enumerate(zip(offsets.tolist(), offsets[1:].tolist())):
        if r1 > r0:
            want = quant_linear(x[r0:r1], w.expert(e), None if b is None else b[e], batch_invariant=True)
            assert torch.equal(out[r0:r1], want), (name, e, r1 - r0)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(("counts", "k", "n"), GROUPS[:4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference(cpu_kind, name, counts, k, n, dtype):
    x, offsets, w, b = _case(name, counts, k, n, dtype, bias=True, seed=1)
    got = grouped_quant_linear(x, offsets, w, b).double()
    want = grouped_quant_linear_ref(x, offsets, w, b)
    weight = torch.stack([dequantize_ref(w.expert(e)) for e in range(len(counts))])
    expert = torch.searchsorted(offsets[1:], torch.arange(x.shape[0]), right=True)
    scale = torch.einsum("mk,mnk->mn", x.double().abs(), weight.abs()[expert])
    # fp32 sums of exact products (Q4_1's offsets as large as the weights: 8x), then bf16's one rounding
    bound = 8 * k * 2**-24 * scale + (2**-8 * want.abs() if dtype == torch.bfloat16 else 0) + 1e-6
    assert ((got - want).abs() <= bound).all()


@pytest.mark.parametrize("name", FORMATS)
def test_without_cpp_kernels(name):
    x, offsets, w, b = _case(name, (2, 0, 5), 64, 21, torch.float32, bias=True, seed=2)
    with cpu.use_cpu_kernels(False):
        got = grouped_quant_linear(x, offsets, w, b).double()
    want = grouped_quant_linear_ref(x, offsets, w, b)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_mxfp4_from_ocp_keeps_the_values():
    """A checkpoint's MXFP4 (codes 2j, 2j + 1 in byte j; scale 2^(s - 127)) repacked to ggml's blocks decodes to
    the values engine.moe.dequantize_mxfp4 (transformers' reading) gives, every code and sign."""
    from agentrt.engine.moe import dequantize_mxfp4

    gen = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 5, 4), generator=gen, dtype=torch.uint8)
    packed = mxfp4_from_ocp(blocks, scales, rows=2)  # slices of 2 of the 15 leading rows
    assert packed.shape == (3, 5, 4 * 17)
    want = dequantize_mxfp4(blocks, scales, torch.float64)
    for e in range(3):
        assert torch.equal(dequantize_ref(QuantWeight(packed[e], TYPE_IDS["MXFP4"], (5, 128))), want[e])


def test_bad_input_is_named():
    x, offsets, w, _ = _case("Q8_0", (2, 3), 64, 8, torch.float32, bias=False)
    with pytest.raises(ValueError, match=r"x \[M, K = 64\].*\(5, 32\)"):
        grouped_quant_linear(x[:, :32], offsets, w)
    with pytest.raises(ValueError, match=r"offsets \[E \+ 1\] = \[3\].*\(2,\)"):
        grouped_quant_linear(x, offsets[:2], w)
    with pytest.raises(ValueError, match=r"bias \[E, N\] = \[2, 8\].*\(2, 9\)"):
        grouped_quant_linear(x, offsets, w, torch.zeros(2, 9))
    with pytest.raises(ValueError, match=r"QuantExperts of shape \(3, 8, 64\).*E = 3.*\(2, 8, 68\)"):
        QuantExperts(w.data, w.type_id, (3, 8, 64))
    if cpu.available():
        with pytest.raises(RuntimeError, match="offsets run from 0 to the 5 rows of x, got 0 .. 4"):
            grouped_quant_linear(x, torch.tensor([0, 2, 4]), w)
