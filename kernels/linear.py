"""linear: `x @ weight.T (+ bias)` for the engine's projections, fastest path per device, dtype and row count.

No Triton kernel here: on a GPU cuBLAS (through `F.linear`) is the right GEMM. On CPU our C++
kernels (kernels/cpu.py) run from a copy of the weight packed once (rebuilt if the weight changes;
it costs the weight's memory a second time):

- fp32: `packed_linear` for every row count, over panels of 16 weight rows ([N/16, K, 16]).
  Measured on a 2-core AMD EPYC (Zen 3, AVX2) over the projections of SmolLM2-135M: 1 row streams
  the weight at ~17 GB/s (oneDNN ~10, MKL's sgemm ~7); 32 / 64 / 512 rows run at 82 / 108 / 128
  GFLOP/s vs oneDNN's 56 / 66 / 113 (`torch.ops.mkldnn._linear_pointwise`, the op inductor uses for
  CPU linears; MKL's sgemm is slower still on this AMD CPU).
- bf16: `packed_linear_bf16` up to `BF16_PACKED_MAX_ROWS` rows (decode), over panels of 32 weight
  rows holding k in pairs ([N/32, K/2, 32, 2], the operand layout of AVX512-BF16's dot product; on
  an AMX CPU the same panels feed AMX's tile dot product, where K is a multiple of 32: on a Sapphire
  Rapids-class Xeon a 64-row decode step of SmolLM2-135M 111 -> 46 ms, `AGENTRT_CPU_AMX=0` turns it
  off); more rows (prefill) go to the library's bf16 GEMM (`F.linear`: oneDNN, with AVX512-BF16 or
  AMX where the CPU has them). Output rounded to bf16 once, from an fp32 accumulator, as the library does.
  Where the kernels are built without AVX512-BF16, every row count takes `packed_linear_bf16`: from 16
  rows it widens each panel to fp32 once and runs the fp32 register tiles over it (the library's bf16
  GEMM there converts with no bf16 arithmetic either, at a sixth of the fp32 GEMM's rate).

Without the C++ kernels (no compiler): fp32 through oneDNN, and for 2-8 rows `W @ x.T` (the weight as
the streamed operand, about one row's cost); bf16 and other dtypes and devices through `F.linear`.
All compute the same dot products in a different summation order (differences ~1e-6 relative in
fp32), the usual GEMM-library freedom.
"""

from __future__ import annotations

import mmap
import sys

import torch
import torch.nn.functional as F

from agentrt.kernels import cpu
from agentrt.kernels.quant import QuantWeight, quant_linear


def _has_onednn_linear() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _has_onednn_linear()
SMALL_M_MAX = 8  # without the C++ kernels: rows up to which `W @ x.T` beats the libraries' x @ W.T
PANEL = 16  # weight rows per panel of the fp32 packed layout (kernels/csrc/linear.h)
PANEL_BF16 = 32  # weight rows per panel of the bf16 packed layout
BF16_PACKED_MAX_ROWS = 64  # bf16 rows up to which the packed kernel beats the library GEMM (measured, docs/benchmarks/throughput.md)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] -> [ceil(N / 16), K, 16]: panels of 16 weight rows, each transposed (rows past N are
    zero), the layout `packed_linear` streams."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    w = F.pad(weight.detach(), (0, 0, 0, panels * PANEL - n)) if n % PANEL else weight.detach()
    return w.reshape(panels, PANEL, k).transpose(1, 2).contiguous()


def pack_linear_weight_bf16(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] -> [ceil(N / 32), ceil(K / 2), 32, 2]: panels of 32 weight rows, k in pairs (rows past
    N and a last odd k are zero), the layout `packed_linear_bf16` streams."""
    n, k = weight.shape
    panels, pairs = -(-n // PANEL_BF16), -(-k // 2)
    w = F.pad(weight.detach(), (0, 2 * pairs - k, 0, panels * PANEL_BF16 - n))
    return w.view(panels, PANEL_BF16, pairs, 2).permute(0, 2, 1, 3).contiguous()


HUGE_PAGE = 2 << 20  # x86-64 transparent huge page


def on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of contiguous CPU tensors laid out in one anonymous mapping that Linux backs with 2 MB
    pages (`madvise(MADV_HUGEPAGE)`: transparent huge pages in their default `madvise` mode), each
    copy 4 KB aligned; the mapping lives as long as any copy (torch.frombuffer holds it).

    Why: decode streams every packed weight once per token, and with 4 KB pages the hardware
    prefetcher stops at each page edge and every 4 KB costs a TLB walk. Measured on a 2-core AMD EPYC
    (one-row GEMV over 30 weights of 3.5 MB, docs/benchmarks/throughput.md): 21-24 -> 27-41 GB/s in bf16,
    35 -> 46 GB/s in fp32. Where huge pages cannot be had (not Linux, THP disabled, no free 2 MB
    frames) the copies still work, on whatever pages the kernel gave. The inputs unchanged where
    the platform has no `madvise`."""
    if not tensors or not hasattr(mmap, "MADV_HUGEPAGE") or sys.platform != "linux":
        return list(tensors)
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(-(-n // 4096) * 4096 for n in sizes)
    buf = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = torch.frombuffer(buf, dtype=torch.uint8)  # the mapping's address, to start at a 2 MB boundary
    off = -view.data_ptr() % HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out: plain pages
        pass
    out = []
    for t, n in zip(tensors, sizes, strict=True):
        assert t.device.type == "cpu" and t.is_contiguous(), "on_huge_pages takes contiguous CPU tensors"
        copy = view[off : off + n].view(t.dtype).view(t.shape)
        copy.copy_(t)
        out.append(copy)
        off += -(-n // 4096) * 4096
    return out


class PackCache:
    """A weight's packed copy for the C++ linear kernels (and its bias in fp32), rebuilt when the
    weight tensor changes (new storage or an in-place write since packing; inference tensors track
    no versions, so for them only new storage counts)."""

    __slots__ = ("bias", "bias_key", "key", "packed")

    def __init__(self):
        self.key, self.packed, self.bias_key, self.bias = None, None, None, None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = _version_key(weight)
        if key != self.key:
            pack = pack_linear_weight_bf16 if weight.dtype == torch.bfloat16 else pack_linear_weight
            self.packed, self.key = pack(weight), key
        return self.packed

    def rehome(self, packed: torch.Tensor) -> None:
        """Serve `packed` (an equal copy of the current packed weight, e.g. on huge pages) from now on."""
        assert self.packed is not None and packed.shape == self.packed.shape and packed.dtype == self.packed.dtype
        self.packed = packed

    def get_bias_f32(self, bias: torch.Tensor) -> torch.Tensor:
        key = _version_key(bias)
        if key != self.bias_key:
            self.bias, self.bias_key = bias.detach().float().contiguous(), key
        return self.bias


def _version_key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, None if t.is_inference() else t._version, tuple(t.shape)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: torch's own `F.linear`."""
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           pack_cache: PackCache | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """x: [..., K], weight: [N, K] (nn.Linear layout), bias: [N] or None -> [..., N].

    `pack_cache` (owned by the caller, one per weight) enables the C++ path on CPU. `batch_invariant`: every
    row count takes the same C++ kernel (bf16 prefill too, instead of the library GEMM above
    BF16_PACKED_MAX_ROWS): on AMX CPUs the AMX one (kernels/csrc/linear.h, where K is a multiple of 32; on a
    Sapphire Rapids-class Xeon faster than both the AVX512-BF16 tiles and oneDNN from 1 to 512 rows), else
    the packed tiles, which sum each row's products in one order whatever the row count: a row's output does
    not depend on the other rows. (fp32 with the C++ kernels is that way already.)"""
    if (x.device.type == "cpu" and x.dtype == torch.bfloat16 and weight.dtype == x.dtype and pack_cache is not None
            and x.numel() and not torch.is_grad_enabled()):
        x2 = x.reshape(-1, x.shape[-1])
        if (ops := cpu.ops()) is not None and (batch_invariant or x2.shape[0] <= BF16_PACKED_MAX_ROWS
                                               or cpu.compiled_isa() != "avx512_bf16"):
            b = None if bias is None else pack_cache.get_bias_f32(bias)
            out = ops.packed_linear_bf16(x2.contiguous(), pack_cache.get(weight), b, weight.shape[0], batch_invariant)
            return out.view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)
    if (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == x.dtype and weight.is_contiguous()
            and x.numel() and not torch.is_grad_enabled()):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        if pack_cache is not None and (ops := cpu.ops()) is not None:
            out = ops.packed_linear(x2, pack_cache.get(weight), bias, weight.shape[0])
        elif 2 <= x2.shape[0] <= SMALL_M_MAX:
            # weight as the GEMM's streamed operand: 2-8 rows cost about what one row does
            out = torch.mm(weight, x2.t()).t().contiguous()
            if bias is not None:
                out += bias
        elif _ONEDNN:
            out = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
        else:
            out = F.linear(x2, weight, bias)
        return out.view(*lead, weight.shape[0])
    return F.linear(x, weight, bias)


class Linear(torch.nn.Linear):
    """`nn.Linear` whose forward goes through `linear` (same parameters, same state-dict names), or through
    `kernels.quant.quant_linear` when it holds a weight kept in GGUF blocks (`quant`, set by the engine's
    loader, which then drops the widened `weight`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pack_cache = PackCache()
        self.batch_invariant = False  # set by the engine's deterministic mode (`linear`)
        self.quant: tuple[QuantWeight, ...] | None = None  # the weight's row parts in GGUF block formats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return quant_linear(x, self.quant, self.bias, self.batch_invariant)
        return linear(x, self.weight, self.bias, self.pack_cache, self.batch_invariant)
