"""linear: `x @ weight.T (+ bias)` for the engine's projections, fastest path per device.

No Triton kernel here: on a GPU cuBLAS (through `F.linear`) is the right GEMM. On CPU (fp32), two
paths, both measured on a 2-core AMD EPYC (AVX2) with the 121 projections of SmolLM2-135M:
- 1-8 rows (decode, speculative drafts): our C++ `small_linear` (kernels/cpu.py) over a packed copy
  of the weight, one sequential read of it: ~18 GB/s, vs ~10 GB/s for oneDNN and ~7 GB/s for MKL's
  sgemm, whose packing and tiling are built for large M. The packed copy ([N/4, K/8, 4, 8], made
  once per weight and rebuilt if the weight changes) costs the weight's memory a second time.
- more rows (prefill, batched decode): oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`, the
  op inductor itself uses for CPU linears): 230 ms for 64 rows vs 372 ms through MKL's sgemm.
Without the C++ kernels (no compiler), 2-8 rows take `W @ x.T` (the weight as the streamed operand,
about one row's cost) and one row oneDNN. Elsewhere `F.linear`.

All compute the same fp32 dot products in a different summation order (differences ~1e-6
relative), the usual GEMM-library freedom.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu


def _has_onednn_linear() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _has_onednn_linear()
_ONEDNN_DTYPES = (torch.float32,)
SMALL_M_MAX = 8  # rows up to which one streamed pass over the weight beats the libraries' GEMMs
PACK_ROWS = 4  # weight rows per group of the packed layout (kernels/csrc/cpu_ops.cpp)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 4), K / 8, 4, 8]: groups of 4 rows interleaved 8 columns at a time (rows
    past N are zero), the layout `small_linear` streams. K must be a multiple of 8."""
    n, k = weight.shape
    groups = -(-n // PACK_ROWS)
    w = F.pad(weight.detach(), (0, 0, 0, groups * PACK_ROWS - n)) if n % PACK_ROWS else weight.detach()
    return w.reshape(groups, PACK_ROWS, k // 8, 8).transpose(1, 2).contiguous()


class PackCache:
    """A weight's packed copy for the small-row kernel, rebuilt when the weight tensor changes
    (new storage or an in-place write since packing; inference tensors track no versions, so for
    them only new storage counts)."""

    __slots__ = ("key", "packed")

    def __init__(self):
        self.key, self.packed = None, None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), None if weight.is_inference() else weight._version, tuple(weight.shape))
        if key != self.key:
            self.packed, self.key = pack_linear_weight(weight), key
        return self.packed


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: torch's own `F.linear`."""
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           pack_cache: PackCache | None = None) -> torch.Tensor:
    """x: [..., K], weight: [N, K] (nn.Linear layout), bias: [N] or None -> [..., N].

    `pack_cache` (owned by the caller, one per weight) enables the C++ small-row path on CPU."""
    if (_ONEDNN and x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and weight.dtype == x.dtype
            and weight.is_contiguous() and not torch.is_grad_enabled()):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        rows, k = x2.shape
        if (pack_cache is not None and 1 <= rows <= SMALL_M_MAX and k % 8 == 0 and (ops := cpu.ops()) is not None
                and (bias is None or bias.dtype == x.dtype)):
            out = ops.small_linear(x2.contiguous(), pack_cache.get(weight), bias, weight.shape[0])
        elif 2 <= rows <= SMALL_M_MAX:
            # weight as the GEMM's streamed operand: 2-8 rows cost about what one row does
            out = torch.mm(weight, x2.t()).t().contiguous()
            if bias is not None:
                out += bias
        else:
            out = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), weight, bias, "none", [], "")
        return out.view(*lead, weight.shape[0])
    return F.linear(x, weight, bias)


class Linear(torch.nn.Linear):
    """`nn.Linear` whose forward goes through `linear` (same parameters, same state-dict names)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pack_cache = PackCache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.pack_cache)
