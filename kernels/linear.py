"""linear: `x @ weight.T (+ bias)` for the engine's projections, fastest path per device.

No Triton kernel here: on a GPU cuBLAS (through `F.linear`) is the right GEMM. On CPU in fp32 our
C++ `packed_linear` (kernels/cpu.py) runs every projection from a copy of the weight packed in panels
of 16 rows ([N/16, K, 16], made once per weight, rebuilt if the weight changes; it costs the
weight's memory a second time). Measured on a 2-core AMD EPYC (Zen 3, AVX2) over the projections of
SmolLM2-135M: 1 row streams the weight at ~17 GB/s (oneDNN ~10, MKL's sgemm ~7); 32 / 64 / 512
rows run at 82 / 108 / 128 GFLOP/s vs oneDNN's 56 / 66 / 113 (`torch.ops.mkldnn._linear_pointwise`,
the op inductor uses for CPU linears; MKL's sgemm is slower still on this AMD CPU).
Without the C++ kernels (no compiler): oneDNN, and for 2-8 rows `W @ x.T` (the weight as the
streamed operand, about one row's cost). Other dtypes and devices: `F.linear`.

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
SMALL_M_MAX = 8  # without the C++ kernels: rows up to which `W @ x.T` beats the libraries' x @ W.T
PANEL = 16  # weight rows per panel of the packed layout (kernels/csrc/cpu_ops.cpp)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16]: panels of 16 weight rows, each transposed (rows past N are
    zero), the layout `packed_linear` streams."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    w = F.pad(weight.detach(), (0, 0, 0, panels * PANEL - n)) if n % PANEL else weight.detach()
    return w.reshape(panels, PANEL, k).transpose(1, 2).contiguous()


class PackCache:
    """A weight's packed copy for `packed_linear`, rebuilt when the weight tensor changes
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

    `pack_cache` (owned by the caller, one per weight) enables the C++ path on CPU."""
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
    """`nn.Linear` whose forward goes through `linear` (same parameters, same state-dict names)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pack_cache = PackCache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.pack_cache)
