"""kernels.quant: GGUF block formats decoded exactly, and `x @ W.T` from the packed bytes on every CPU kind.

The independent reference is the `gguf` package's own decoder (`gguf.quants.dequantize`); blocks come from
its quantizer where it has one (Q4_0, Q4_1, Q5_0, Q8_0) and are random bytes with sane fp16 scales for the
K-quants (every bit pattern of their integer parts is a valid block).
"""

import numpy as np
import pytest
import torch

from agentrt.kernels import cpu
from agentrt.kernels.linear import pack_linear_weight_bf16
from agentrt.kernels.quant import (FORMATS, INTEGER_DOT_FORMATS, TYPE_IDS, WIDEN_MIN_ROWS, QuantWeight, dequantize,
                                  dequantize_ref, integer_dot, quant_linear, quant_linear_ref, quantize)

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

NAMES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]


def make_weight(name: str, n: int, k: int, seed: int = 0) -> tuple[QuantWeight, np.ndarray]:
    """A packed [n, k] weight of format `name` and its raw bytes."""
    rng = np.random.default_rng(seed)
    type_id = TYPE_IDS[name]
    _, block, nbytes = FORMATS[type_id]
    qtype = gguf.GGMLQuantizationType[name]
    try:
        raw = gguf_quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    except NotImplementedError:
        raw = rng.integers(0, 256, (n, k // block * nbytes), dtype=np.uint8)
        blocks = raw.reshape(-1, nbytes)
        scale = lambda: (rng.random(len(blocks)) * 0.02 + 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)  # noqa: E731
        if name == "Q6_K":
            blocks[:, 208:210] = scale()
        else:  # d, dmin
            blocks[:, 0:2], blocks[:, 2:4] = scale(), scale()
    raw = np.ascontiguousarray(raw)
    return QuantWeight(torch.from_numpy(raw.copy()), type_id, (n, k)), raw


@pytest.mark.parametrize("name", NAMES)
def test_reference_decodes_as_gguf_does(name):
    block = FORMATS[TYPE_IDS[name]][1]
    w, raw = make_weight(name, 5, 2 * block)
    want = gguf_dequantize(raw, gguf.GGMLQuantizationType[name]).astype(np.float64)
    got = dequantize_ref(w)
    assert got.dtype == torch.float64 and got.shape == (5, 2 * block)
    # gguf decodes in fp32; every product here is exact in fp32 or rounded once, so the fp32 rounding agrees
    assert torch.equal(got.float().double(), torch.from_numpy(want))


@pytest.mark.parametrize("name", NAMES)
def test_kernel_decodes_blocks_exactly(name, cpu_kind):
    block = FORMATS[TYPE_IDS[name]][1]
    w, _ = make_weight(name, 19, 3 * block, seed=1)
    got = cpu.ops().quant_dequantize(w.data, w.type_id, 19, 3 * block)
    assert torch.equal(got, dequantize_ref(w).float())


# (n, k) per block size: n not a multiple of the 16-row panels, k an odd number of blocks
SHAPES = {32: [(37, 96), (16, 32), (130, 160)], 256: [(37, 256), (21, 768)]}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300])
def test_quant_linear_matches_reference(name, rows, cpu_kind):
    block = FORMATS[TYPE_IDS[name]][1]
    gen = torch.Generator().manual_seed(rows)
    for i, (n, k) in enumerate(SHAPES[block]):
        w, _ = make_weight(name, n, k, seed=i)
        x = torch.randn(rows, k, generator=gen)
        bias = torch.randn(n, generator=gen) if i % 2 else None
        got = quant_linear(x, w, bias)
        want = quant_linear_ref(x, w, bias)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        # fp32 accumulation over k products: |err| <= ~k * eps * sum|x w|
        bound = 4 * k * 2**-24 * (x.double().abs() @ dequantize_ref(w).abs().T) + 1e-6
        assert ((got.double() - want).abs() <= bound).all(), (name, rows, n, k)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rows", [1, 3, 5, WIDEN_MIN_ROWS - 1, WIDEN_MIN_ROWS, WIDEN_MIN_ROWS + 1, 64, 300])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_quant_linear_bf16_rows_match_reference(name, rows, batch_invariant, cpu_kind):
    # bf16 x (the engine's dtype): on AVX512-BF16 the blocks' integers times x (quant_bf16.h), or from WIDEN_MIN_ROWS
    # rows panels widened to bf16 weights; elsewhere widened to fp32; the output is the fp32 sum rounded to bf16 once
    block = FORMATS[TYPE_IDS[name]][1]
    gen = torch.Generator().manual_seed(100 + rows)
    for i, (n, k) in enumerate(SHAPES[block]):
        w, _ = make_weight(name, n, k, seed=i)
        x = torch.randn(rows, k, generator=gen).bfloat16()
        bias = torch.randn(n, generator=gen) if i % 2 else None
        got = quant_linear(x, w, bias, batch_invariant)
        want = quant_linear_ref(x, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        # fp32 sums of the factored products (c terms as large as the largest weight: 8x), then one bf16 rounding (half an ulp: <= 2^-8 relative)
        sum_abs = x.double().abs() @ dequantize_ref(w).abs().T
        bound = 8 * k * 2**-24 * sum_abs + 2**-8 * want.abs() + 1e-6
        if widens(rows, batch_invariant, cpu_kind):  # each weight rounded to bf16: half an ulp, 2^-9 relative
            bound += 2**-9 * sum_abs
        if cpu_kind == "avx512_bf16" and integer_dot(name, rows, k, batch_invariant):
            bound += x_rounding(x) @ dequantize_ref(w).abs().T  # x as 15-bit integers per 32 (quant_vnni.h)
        assert ((got.double() - want).abs() <= bound).all(), (name, rows, n, k)


def x_rounding(x: torch.Tensor) -> torch.Tensor:
    """The integer dot products' rounding of each element of x [M, K]: half a step of its 32's scale, max / 16256."""
    m, k = x.shape
    return (x.double().abs().view(m, k // 32, 32).amax(-1) / 32512).repeat_interleave(32, -1)


def x_rounded(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 as the integer dot products take it (quant_vnni.h VnniX): per 32, s = max / 16256 and
    x_q = round(x * (16256 / max)) in fp32, ties to even; returns s * x_q in float64."""
    m, k = x.shape
    v = x.float().view(m, k // 32, 32)
    mx = v.abs().amax(-1, keepdim=True)
    inv = torch.where(mx > 0, torch.tensor(16256.0) / mx, torch.zeros_like(mx))
    q = torch.round(v * inv).clamp(-16256, 16256)
    return (q.double() * (mx / 16256).double()).view(m, k)


@pytest.mark.parametrize("name", sorted(INTEGER_DOT_FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_decode_rows_take_integer_dot_products_within_x_rounding(name, rows, cpu_kind):
    # 1-4 bf16 rows outside the invariant mode: x rounded once, to 2^-15 of its 32's largest element (an outlier
    # coarsens only its own 32), then exact integer products summed in fp32
    if not integer_dot(name, rows, 256, False):
        pytest.skip("the integer dot products need the avx512_bf16 kernels on a CPU with AVX512-VNNI")
    block = FORMATS[TYPE_IDS[name]][1]
    gen = torch.Generator().manual_seed(rows)
    k = 768 if block == 256 else 640
    w, _ = make_weight(name, 70, k, seed=rows)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    x[0, 37] = 300.0  # a large activation: its 32 are coarser, no other
    got = quant_linear(x, w).double()
    want = quant_linear_ref(x, w, None)
    W = dequantize_ref(w).abs().T
    err = (got - want).abs()
    assert (err <= 8 * k * 2**-24 * (x.double().abs() @ W) + 2**-8 * want.abs() + x_rounding(x) @ W + 1e-6).all()
    # and exactly that rounding: against x rounded so (in fp32 as the kernel does, per 32), the products leave only
    # fp32 sums and the output's bf16 rounding (x in 8 bits per 32, as llama.cpp takes it, fails this)
    xq = x_rounded(x)
    want_q = xq @ dequantize_ref(w).double().T
    assert ((got - want_q).abs() <= 8 * k * 2**-24 * (xq.abs() @ W) + 2**-8 * want_q.abs() + 1e-6).all()
    assert not torch.equal(got, quant_linear(x, w, batch_invariant=True).double())  # the integer path ran


def widens(rows: int, batch_invariant: bool, kind: str) -> bool:
    """Whether quant_linear of `rows` bf16 rows runs the panels widened to bf16 (kernels/csrc/quant_bf16.h)."""
    return kind == "avx512_bf16" and not batch_invariant and rows >= WIDEN_MIN_ROWS


# (n, k): partial panels of 32 weight rows (37 = 32 + 5, 130 = 4 * 32 + 2, 16), k an odd number of blocks or 2 K-blocks
WIDEN_SHAPES = {32: [(37, 96), (16, 32), (130, 160)], 256: [(37, 256), (70, 512)]}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rows", [WIDEN_MIN_ROWS - 1, WIDEN_MIN_ROWS, 13, 64, 301])
def test_many_rows_are_the_widened_engines_product(name, rows, cpu_kind):
    # from WIDEN_MIN_ROWS rows (not batch-invariant, AVX512-BF16): the widened engine's numbers, bit for bit: its weight
    # (the fp32 decoding rounded to bf16 once, as the loader widens) through its packed bf16 kernel; fewer rows (and
    # other kinds) the blocks' own path, the batch-invariant one
    block = FORMATS[TYPE_IDS[name]][1]
    gen = torch.Generator().manual_seed(7 * rows)
    ops = cpu.ops()
    for i, (n, k) in enumerate(WIDEN_SHAPES[block]):
        w, _ = make_weight(name, n, k, seed=10 + i)
        x = torch.randn(rows, k, generator=gen).bfloat16()
        bias = torch.randn(n, generator=gen) if i % 2 == 0 else None
        got = quant_linear(x, w, bias)
        if widens(rows, False, cpu_kind):
            packed = pack_linear_weight_bf16(dequantize(w).bfloat16())
            want = ops.packed_linear_bf16(x, packed, None if bias is None else bias.float(), n, False)
        elif integer_dot(name, rows, k, False):  # the integer dot products: test_decode_rows_take_integer_dot_...
            continue
        else:
            want = quant_linear(x, w, bias, batch_invariant=True)
        assert torch.equal(got, want), (name, rows, n, k)


def test_quant_linear_bf16_and_leading_dims():
    w, _ = make_weight("Q4_1", 24, 64)
    x = torch.randn(2, 3, 64).bfloat16()
    got = quant_linear(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 24)
    assert torch.equal(got, quant_linear(x.reshape(6, 64), w).reshape(2, 3, 24))
    want = quant_linear_ref(x.reshape(6, 64), w).reshape(2, 3, 24)
    # 6 rows: on AVX512-BF16 the weights widened to bf16 (2^-9 of sum |x w|), then the output's bf16 rounding
    sum_abs = (x.double().abs() @ dequantize_ref(w).abs().T)
    assert ((got.double() - want).abs() <= 2**-8 * sum_abs + 2**-8 * want.abs() + 1e-6).all()


def test_quant_weight_rejects_bad_input():
    w, raw = make_weight("Q4_0", 4, 64)
    with pytest.raises(ValueError, match="GGUF block type 1 is not supported"):
        QuantWeight(w.data, 1, (4, 64))
    with pytest.raises(ValueError, match="in_features 48 is not a multiple of 32"):
        QuantWeight(w.data, w.type_id, (4, 48))
    with pytest.raises(ValueError, match=r"needs contiguous uint8 data \(4, 36\)"):
        QuantWeight(w.data[:, :18].contiguous(), w.type_id, (4, 64))
    with pytest.raises(ValueError, match="x has 32 features"):
        quant_linear(torch.randn(1, 32), w)


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K", "Q6_K", "MXFP4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_batch(name, dtype, cpu_kind):
    # the engine's deterministic mode: a row's output is the same bits alone, in a few rows or in many
    block = FORMATS[TYPE_IDS[name]][1]
    w, _ = make_weight(name, 40, 2 * block)
    x = torch.randn(37, 2 * block).to(dtype)
    batched = quant_linear(x, w, batch_invariant=True)
    for i in (0, 5, 36):
        assert torch.equal(quant_linear(x[i : i + 1], w, batch_invariant=True)[0], batched[i])
        assert torch.equal(quant_linear(x[i : i + 3], w, batch_invariant=True)[0], batched[i])
    if dtype == torch.float32 or cpu_kind != "avx512_bf16":  # no widened panels: invariant whatever the flag
        assert torch.equal(quant_linear(x, w), batched)


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 37, 70])
def test_mxfp4_scales_at_the_edges_of_the_folded_table(rows, cpu_kind):
    # bf16 x on AVX512-BF16 puts an MXFP4 block's power-of-two scale into its lookup table where the moved exponents
    # stay normal (exponent bytes 2..252) and scales the block's products otherwise (quant_bf16.h chunk_mxfp4); with AMX
    # a panel of 16 weight rows whose blocks all fold runs on the tiles, any other on the registers (fold_panel_amx).
    # Panels of both kinds in one weight, every exponent byte on both sides of the edges: exact against the reference,
    # and a row's output does not depend on the rows beside it (1-4 rows, the many-row tiles, two AMX passes)
    edges = [0, 1, 2, 3, 100, 127, 128, 129, 200, 250, 251, 252]
    if cpu_kind == "avx512_bf16":  # past 252 a block's largest weights exceed fp32: the fp32 paths cannot hold them
        edges += [253, 254, 255]
    n, k = 40, 32 * len(edges)
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, (n, k // 32, 17), dtype=np.uint8)
    raw[:, :, 0] = rng.integers(2, 253, (n, k // 32))  # panels 0 and 2 (rows 0-15, 32-39) fold
    raw[16:32, :, 0] = np.array([np.roll(edges, r) for r in range(16)], dtype=np.uint8)  # panel 1: every edge
    w = QuantWeight(torch.from_numpy(raw.reshape(n, -1).copy()), TYPE_IDS["MXFP4"], (n, k))
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2.0**-100).bfloat16()  # no overflow at 2^127
    got = quant_linear(x, w, batch_invariant=True)
    want = quant_linear_ref(x, w)
    sum_abs = x.double().abs() @ dequantize_ref(w).abs().T
    bound = 8 * k * 2**-24 * sum_abs + 2**-8 * want.abs() + 2**-130
    assert ((got.double() - want).abs() <= bound).all()
    for i in {0, rows - 1}:
        assert torch.equal(quant_linear(x[i : i + 1], w, batch_invariant=True)[0], got[i])


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1"])
def test_quantize_makes_blocks_gguf_decodes_within_half_a_step(name):
    # --quantization int8 / int4: ggml's layouts (the gguf package decodes them), each weight within half a step of
    # its block (plus the fp16 rounding of Q4_1's minimum)
    w = torch.randn(37, 160, generator=torch.Generator().manual_seed(3)) * 0.02
    w[5, :32] = 0  # an all-zero block: scale 0, weights 0
    qw = quantize(w.bfloat16(), name, rows=16)  # slices of rows: the same bytes as one pass
    assert torch.equal(qw.data, quantize(w.bfloat16(), name).data) and qw.shape == (37, 160)
    got = dequantize_ref(qw)
    assert np.array_equal(got.float().numpy(), gguf_dequantize(qw.data.numpy(), gguf.GGMLQuantizationType[name]))
    nbytes = FORMATS[TYPE_IDS[name]][2]
    step = qw.data.view(-1, nbytes)[:, :2].contiguous().view(torch.float16).double()  # d per block: [blocks, 1]
    b, wb = got.reshape(-1, 32), w.bfloat16().double().reshape(-1, 32)
    slack = 0 if name == "Q8_0" else wb.abs().amax(1, keepdim=True) * 2**-11  # Q4_1's minimum rounded to fp16
    assert ((b - wb).abs() <= step / 2 * (1 + 1e-3) + slack).all()
    assert (got[5, :32] == 0).all()


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="Q8_0 or Q4_1 blocks, not 'Q4_K'"):
        quantize(torch.zeros(2, 32), "Q4_K")
    with pytest.raises(ValueError, match="in_features 48 of a \\(2, 48\\) weight is not a multiple of 32"):
        quantize(torch.zeros(2, 48), "Q8_0")
