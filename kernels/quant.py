"""quant: `x @ W.T (+ bias)` where W stays in a GGUF (ggml) block format, decoded in the kernel.

A GGUF file stores most projections as blocks of 32 (Q4_0, Q4_1, Q5_0, Q8_0) or 256 (Q4_K, Q5_K, Q6_K)
weights, each block a few fp16 scales and packed 4-8 bit integers (the layouts: kernels/csrc/quant.h).
Widening them to bf16 costs 3-4x their bytes in memory, and a CPU decode step, which reads every
weight once, reads those 3-4x bytes too. `QuantWeight` keeps the file's bytes, [N, K / B * block bytes]
uint8, and `quant_linear` runs the C++ kernel (`torch.ops.agentrt_cpu_<kind>.quant_linear`, built per
CPU kind like the bf16 path, kernels/cpu.py): for 5+ rows threads take panels of 16 weight rows,
decode a panel to fp32 once (L2) and run every row of x over it in register tiles (a prefill decodes
the weight once per call); for 1-4 rows 4 weight rows are decoded block by block into L1 and dotted
with each row (one pass over the packed bytes). Both sum each output in the same order whatever the
row count: batch-invariant by construction. An fp32 x is computed in fp32. A bf16 x (the engine's dtype)
on an AVX512-BF16 build takes kernels/csrc/quant_bf16.h: each block's small integers (exact in bf16) times x
by `vdpbf16ps`, the block's scales applied once per 32 weights (at 1 row ~1.2-1.5x the fp32 tiles' rate on
4-bit formats, ~2x on Q6_K), the same products and order for every row count; elsewhere it is widened to fp32
on entry. The output is rounded to bf16 once; accumulation is fp32.

From `WIDEN_MIN_ROWS` bf16 rows on AVX512-BF16 (a batched decode step, a prefill) the kernel instead widens each
panel of 32 weight rows to bf16 on the fly (each weight's fp32 decoding rounded to bf16 once: the weight the
widened engine holds) and runs kernels.linear's bf16 tiles over it, one `vdpbf16ps` per 32 products where the
integer path needs a dot product and an FMA: the output is `packed_linear_bf16`'s over `dequantize(w).bfloat16()`,
bit for bit (at 32 rows of SmolLM2-135M's projections 1.6-2.2x the integer path, 0.7-0.77x the widened weight's
rate: the decoding is the difference). That path sums differently, over bf16-rounded weights (|err| up to 2^-9 of
sum |x w| more), so a row's output would depend on the row count: `batch_invariant=True` (the engine's
deterministic mode, `Linear.batch_invariant`, `decode_forward`'s `invariant`) keeps the integer path for every row
count.

MXFP4 (ggml type 39: gpt-oss's experts) is one of the formats: a block of 32 is an E8M0 byte e and 32 4-bit E2M1
codes, w = 2^(e - 128) * v, v the code's value doubled, an integer in {0, 1, 2, 3, 4, 6, 8, 12} with a sign: "small
integers times a per-32 scale" like the others. A checkpoint's MXFP4 (OCP layout: `*_blocks` with codes 2j and 2j + 1
in byte j, `*_scales`) becomes ggml's by `mxfp4_from_ocp`, values unchanged. A mixture of experts keeps its experts
as `QuantExperts` ([E, N, K / B * bytes], one format), multiplied by `kernels.moe.grouped_quant_linear`.

`dequantize_ref` is the reference: the exact block decoding in float64, in plain torch (tests hold it
against the `gguf` package's own `gguf.quants.dequantize`); `quant_linear_ref` is `F.linear` over it.
Without the C++ kernels (no compiler, or off x86 kinds that failed to build) `quant_linear` widens the
weight per call through the reference: correct, slow; callers that care check `cpu.available()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentrt.kernels import cpu

# ggml type id -> (name, weights per block, bytes per block)
FORMATS: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    39: ("MXFP4", 32, 17),
}
TYPE_IDS = {name: t for t, (name, _, _) in FORMATS.items()}
WIDEN_MIN_ROWS = 5  # bf16 rows from which AVX512-BF16 widens panels to bf16 (quant_bf16.h kQuantWidenMinRows)
# Fewer bf16 rows, outside the batch-invariant mode, on a CPU with AVX512-VNNI: these formats' integer dot products,
# x as 15-bit integers per 32 weights (quant_vnni.h), where K % 64 == 0
INTEGER_DOT_FORMATS = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"})


def integer_dot(format_name: str, rows: int, k: int, batch_invariant: bool) -> bool:
    """Whether quant_linear of `rows` bf16 rows of `k` features against a `format_name` weight takes the integer
    dot products (the compiled kernels' kind avx512_bf16, on a CPU with AVX512-VNNI): x rounded to 15-bit integers
    per 32 features, |x - x'| <= max|x over its 32| / 32512."""
    return (format_name in INTEGER_DOT_FORMATS and 1 <= rows < WIDEN_MIN_ROWS and k % 64 == 0
            and not batch_invariant and cpu.compiled_isa() == "avx512_bf16" and "avx512_vnni" in cpu.cpu_flags())


@dataclass(slots=True, frozen=True)
class QuantWeight:
    """A weight [N, K] kept in a GGUF block format."""

    data: torch.Tensor  # [N, K / block * block_bytes] uint8, contiguous: the file's bytes, row after row
    type_id: int  # ggml type id (FORMATS)
    shape: tuple[int, int]  # (N, K): out_features, in_features

    def __post_init__(self):
        if self.type_id not in FORMATS:
            raise ValueError(f"GGUF block type {self.type_id} is not supported packed; supported: "
                             f"{', '.join(f'{n} ({t})' for t, (n, _, _) in FORMATS.items())}")
        name, block, nbytes = FORMATS[self.type_id]
        n, k = self.shape
        if k % block:
            raise ValueError(f"{name} weight of shape {self.shape}: in_features {k} is not a multiple of {block}")
        want = (n, k // block * nbytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want or not self.data.is_contiguous():
            raise ValueError(f"{name} weight of shape {self.shape} needs contiguous uint8 data {want}, got "
                             f"{tuple(self.data.shape)} {self.data.dtype}")

    @property
    def format_name(self) -> str:
        return FORMATS[self.type_id][0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


@dataclass(slots=True, frozen=True)
class QuantExperts:
    """A mixture's expert weights [E, N, K] kept in one GGUF block format: expert e's rows as a `QuantWeight` of
    shape (N, K) holds them."""

    data: torch.Tensor  # [E, N, K / block * block_bytes] uint8, contiguous
    type_id: int  # ggml type id (FORMATS)
    shape: tuple[int, int, int]  # (E, N, K): experts, out_features, in_features

    def __post_init__(self):
        if len(self.shape) != 3 or self.shape[0] < 1:
            raise ValueError(f"QuantExperts shape (E, N, K) with E >= 1 expected, got {self.shape}")
        if self.data.dim() != 3 or self.data.shape[0] != self.shape[0] or not self.data.is_contiguous():
            raise ValueError(f"QuantExperts of shape {self.shape} needs contiguous data [E, N, bytes] with E = "
                             f"{self.shape[0]}, got {tuple(self.data.shape)}")
        QuantWeight(self.data[0], self.type_id, self.shape[1:])  # the format, K and each row's bytes

    @property
    def format_name(self) -> str:
        return FORMATS[self.type_id][0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def expert(self, e: int) -> QuantWeight:
        return QuantWeight(self.data[e], self.type_id, self.shape[1:])


def quantize_experts(w: torch.Tensor, name: str) -> QuantExperts:
    """Expert weights [E, N, K] as `quantize` makes each expert's blocks (Q8_0 or Q4_1)."""
    if w.dim() != 3:
        raise ValueError(f"quantize_experts: weights [E, N, K] expected, got {tuple(w.shape)}")
    parts = [quantize(w[e], name) for e in range(w.shape[0])]
    return QuantExperts(torch.stack([p.data for p in parts]), parts[0].type_id, tuple(w.shape))


def mxfp4_from_ocp(blocks: torch.Tensor, scales: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """MXFP4 in the OCP layout a checkpoint ships (gpt-oss's `*_blocks` [..., G, 16] uint8, codes 2j and 2j + 1 in
    byte j's low and high nibble; `*_scales` [..., G] uint8, 2^(s - 127)) -> ggml's MXFP4 blocks [..., G * 17]
    (byte 0 the same exponent, then codes j and j + 16 in byte j + 1's low and high nibble): the same values,
    since ggml's codes count halves and its scale 2^(e - 128). In slices of `rows` leading rows (no wide copy)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != 16 \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [..., G, 16] and scales [..., G] of uint8 expected, got "
                         f"{tuple(blocks.shape)} {blocks.dtype} and {tuple(scales.shape)} {scales.dtype}")
    lead, groups = blocks.shape[:-2], blocks.shape[-2]
    b, s = blocks.reshape(-1, groups, 16), scales.reshape(-1, groups)
    out = torch.empty(b.shape[0], groups, 17, dtype=torch.uint8)
    for r in range(0, b.shape[0], rows):
        part = b[r : r + rows]
        codes = torch.stack([part & 15, part >> 4], dim=-1).flatten(-2)  # [rows, G, 32] in weight order
        out[r : r + rows, :, 0] = s[r : r + rows]
        out[r : r + rows, :, 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.reshape(*lead, groups * 17)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian fp16 -> [...] float64."""
    return b.contiguous().view(torch.float16)[..., 0].double()


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 12] uint8 -> the 6-bit scales and mins of the 8 sub-blocks, [n, 8] each (Q4_K / Q5_K)."""
    q = scales.long()
    lo_sc, lo_m = q[:, 0:4] & 63, q[:, 4:8] & 63
    hi_sc = (q[:, 8:12] & 15) | ((q[:, 0:4] >> 6) << 4)
    hi_m = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], 1).double(), torch.cat([lo_m, hi_m], 1).double()


# MXFP4's E2M1 codes as integers: each value doubled (bit 3 the sign), the block scale then 2^(e - 128)
_MXFP4_INTS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] -> [n, 32]: low nibbles then high nibbles."""
    q = qs.long()
    return torch.cat([q & 15, q >> 4], 1)


def dequantize_ref(w: QuantWeight) -> torch.Tensor:
    """The exact values of a packed weight, [N, K] float64."""
    name, block, nbytes = FORMATS[w.type_id]
    n, k = w.shape
    b = w.data.reshape(-1, nbytes)
    if name == "Q8_0":
        q = b[:, 2:].view(torch.int8).double()
        out = _f16(b[:, 0:2].reshape(-1, 1, 2)) * q
    elif name == "Q4_0":
        out = _f16(b[:, 0:2].reshape(-1, 1, 2)) * (_nibbles(b[:, 2:]) - 8).double()
    elif name == "Q4_1":
        out = _f16(b[:, 0:2].reshape(-1, 1, 2)) * _nibbles(b[:, 4:]).double() + _f16(b[:, 2:4].reshape(-1, 1, 2))
    elif name == "Q5_0":
        qh = b[:, 2:6].long()
        qh = qh[:, 0] | (qh[:, 1] << 8) | (qh[:, 2] << 16) | (qh[:, 3] << 24)
        high = (qh[:, None] >> torch.arange(32)) & 1
        out = _f16(b[:, 0:2].reshape(-1, 1, 2)) * ((_nibbles(b[:, 6:]) | (high << 4)) - 16).double()
    elif name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2].reshape(-1, 1, 2)), _f16(b[:, 2:4].reshape(-1, 1, 2))
        sc, m = _k_scale_min(b[:, 4:16])
        qs = b[:, 48:] if name == "Q5_K" else b[:, 16:]
        q = qs.long().reshape(-1, 4, 1, 32) >> torch.tensor([0, 4]).reshape(1, 1, 2, 1)
        q = (q & 15).reshape(-1, 8, 32)  # sub-block 2p: low nibbles of qs[32p:32p+32], 2p+1: high
        if name == "Q5_K":
            qh = b[:, 16:48].long().reshape(-1, 1, 32) >> torch.arange(8).reshape(1, 8, 1)
            q = q | ((qh & 1) << 4)
        out = (d * sc)[:, :, None] * q.double() - (dmin * m)[:, :, None]
    elif name == "Q6_K":
        ql, qh, sc = b[:, 0:128].long(), b[:, 128:192].long(), b[:, 192:208].view(torch.int8).double()
        d = _f16(b[:, 208:210].reshape(-1, 1, 2))
        # weight 128h + 32t + l: low bits (ql[64h + 32(t % 2) + l] >> 4(t // 2)) & 15, high (qh[32h + l] >> 2t) & 3
        low = ql.reshape(-1, 2, 1, 2, 32) >> torch.tensor([0, 4]).reshape(1, 1, 2, 1, 1)
        low = (low & 15).reshape(-1, 2, 4, 32)
        high = (qh.reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6]).reshape(1, 1, 4, 1)) & 3
        q = ((low | (high << 4)) - 32).reshape(-1, 16, 16).double()
        out = (d * sc)[:, :, None] * q
    elif name == "MXFP4":
        e = b[:, 0:1].double()
        values = torch.tensor(_MXFP4_INTS, dtype=torch.float64)[_nibbles(b[:, 1:])]
        out = torch.exp2(e - 128) * values
    else:  # pragma: no cover - FORMATS and this function list the same names
        raise AssertionError(name)
    return out.reshape(n, k)


def quantize(w: torch.Tensor, name: str, rows: int = 4096) -> QuantWeight:
    """A float weight [N, K] (K a multiple of 32) as Q8_0 or Q4_1 blocks of 32, ggml's layouts: the weight-only int8 /
    int4 of `--quantization int8|int4`. Q8_0: d = max|w| / 127 (fp16), q = round(w / d); Q4_1: d = (max - min) / 15,
    m = min (both fp16), q = round((w - m) / d) in 0..15; per block of 32 weights, from the fp16-rounded scales (what
    the kernels decode with). In slices of `rows` rows (no fp32 copy of a whole large weight)."""
    if name not in ("Q8_0", "Q4_1"):
        raise ValueError(f"quantize makes Q8_0 or Q4_1 blocks, not {name!r}")
    n, k = w.shape
    if k % 32:
        raise ValueError(f"quantize: in_features {k} of a {tuple(w.shape)} weight is not a multiple of 32")
    _, _, nbytes = FORMATS[TYPE_IDS[name]]
    out = torch.empty(n, k // 32 * nbytes, dtype=torch.uint8)
    for r in range(0, n, rows):
        b = w[r : r + rows].float().reshape(-1, 32)
        dst = out[r : r + rows].view(-1, nbytes)
        if name == "Q8_0":
            d = (b.abs().amax(1) / 127).half()
            inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
            q = torch.round(b * inv[:, None]).clamp(-127, 127).to(torch.int8)
            dst[:, 0:2] = d.view(torch.uint8).view(-1, 2)
            dst[:, 2:] = q.view(torch.uint8)
        else:
            lo, hi = b.amin(1), b.amax(1)
            d, m = ((hi - lo) / 15).half(), lo.half()
            inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
            q = torch.round((b - m.float()[:, None]) * inv[:, None]).clamp(0, 15).to(torch.uint8)
            dst[:, 0:2] = d.view(torch.uint8).view(-1, 2)
            dst[:, 2:4] = m.view(torch.uint8).view(-1, 2)
            dst[:, 4:] = q[:, :16] | (q[:, 16:] << 4)
    return QuantWeight(out, TYPE_IDS[name], (n, k))


def quant_linear_ref(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: `F.linear` over the exactly decoded weight, in float64."""
    return F.linear(x.double(), dequantize_ref(w), None if bias is None else bias.double())


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The packed weight widened to fp32 [N, K] (the C++ decoder, or the reference without it)."""
    if (ops := cpu.ops()) is not None:
        return ops.quant_dequantize(w.data, w.type_id, w.shape[0], w.shape[1])
    return dequantize_ref(w).float()


def quant_embedding(ids: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """Rows `ids` ([T] int) of a packed [N, K] table, decoded: [T, K] fp32 (an embedding lookup that reads T
    rows' blocks)."""
    rows = w.data.index_select(0, ids.reshape(-1).long())
    return dequantize(QuantWeight(rows, w.type_id, (rows.shape[0], w.shape[1]))).view(*ids.shape, w.shape[1])


def quant_linear(x: torch.Tensor, w: QuantWeight | tuple[QuantWeight, ...], bias: torch.Tensor | None = None,
                 batch_invariant: bool = False) -> torch.Tensor:
    """x: [..., K] fp32 or bf16, w: a packed [N, K] weight, or parts of one stacked by rows (a fused projection
    whose pieces have different formats, e.g. q/k Q4_K and v Q6_K), bias: [N] or None -> [..., N] in x's dtype.
    `batch_invariant` (the engine's deterministic mode): a bf16 x never takes the widened panels (module docstring),
    so a row's output does not depend on the row count."""
    if isinstance(w, tuple):
        if len(w) == 1:
            return quant_linear(x, w[0], bias, batch_invariant)
        starts = [0]
        for p in w:
            starts.append(starts[-1] + p.shape[0])
        return torch.cat([quant_linear(x, p, None if bias is None else bias[a:b], batch_invariant)
                          for p, a, b in zip(w, starts, starts[1:])], dim=-1)
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"quant_linear: x has {x.shape[-1]} features, the {w.format_name} weight {w.shape} takes {k}")
    if x.device.type != "cpu":
        raise ValueError(f"quant_linear runs on CPU only, got x on {x.device}")
    lead = x.shape[:-1]
    b = None if bias is None else bias.float().contiguous()
    if (ops := cpu.ops()) is not None:
        # bf16 x: the op's bf16 path (rounded once); any other dtype runs in fp32
        x2 = x.reshape(-1, k).contiguous() if x.dtype == torch.bfloat16 else x.reshape(-1, k).float().contiguous()
        out = ops.quant_linear(x2, w.data, w.type_id, n, b, batch_invariant)
    else:
        out = F.linear(x.reshape(-1, k).float(), dequantize_ref(w).float(), b)
    return out.to(x.dtype).view(*lead, n)
