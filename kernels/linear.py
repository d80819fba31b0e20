"""linear: `x @ weight.T (+ bias)` for the engine's projections, fastest library path per device.

No Triton kernel here: on a GPU cuBLAS (through `F.linear`) is the right GEMM. On CPU, torch's
`F.linear` for fp32 goes to MKL's sgemm, which on AMD CPUs (and for the small row counts of decode
steps everywhere) runs far below the machine's peak: measured on a 2-core AMD EPYC (AVX2), the 121
projections of SmolLM2-135M take 73 / 150 / 372 ms for 1 / 2 / 64 rows through MKL and 46 / 82 /
230 ms through oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`, the op inductor itself uses
for CPU linears). So on CPU we call oneDNN when torch has it; otherwise `F.linear`. For 2-8 rows
both libraries pack the weight per call; `W @ x.T` (weight as the streamed operand) instead costs
about one row's time (45-50 ms for 2-6 rows, measured as above), which is what makes decode steps
with speculative drafts nearly free.

Both compute the same fp32 dot products in a different summation order (differences ~1e-6
relative), the usual GEMM-library freedom.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _has_onednn_linear() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _has_onednn_linear()
_ONEDNN_DTYPES = (torch.float32,)
SMALL_M_MAX = 8  # rows up to which `W @ x.T` beats both libraries' x @ W.T (decode with drafts, tiny batches)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: torch's own `F.linear`."""
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K], weight: [N, K] (nn.Linear layout), bias: [N] or None -> [..., N]."""
    if (_ONEDNN and x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and weight.dtype == x.dtype
            and weight.is_contiguous() and not torch.is_grad_enabled()):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if 2 <= x2.shape[0] <= SMALL_M_MAX:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
