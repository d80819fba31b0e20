"""rms_norm: RMSNorm of each row, optionally fused with the residual add that precedes it.

`y = weight * (s / sqrt(mean(s^2) + eps))` with `s = x` or, given `residual`, `s = x + residual`
(then `s` is returned too, as the next residual). Rounding follows HF Llama: `s` is rounded to the
input dtype, the statistics are fp32, the normalized row is rounded to the dtype before the weight.

Algorithm: one program per row holding the whole row in registers (`BLOCK >= hidden`).
Memory traffic: reads x (and residual) and weight, writes y (and s): 2-4 passes of T * hidden.
Limits: hidden <= 65536; rows unit-stride along hidden (any row stride).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt.kernels._common import launchable


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    tl.static_assert(BLOCK >= HIDDEN)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = (xf * inv_rms).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    assert x.dim() == 2 and weight.shape == (x.shape[1],), (
        f"x must be [T, hidden] and weight [hidden], got {tuple(x.shape)} and {tuple(weight.shape)}")
    assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype), (
        f"residual must match x {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}")


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher. x: [T, hidden] -> y, or (y, x + residual) when `residual` is given."""
    _check(x, weight, residual)
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1), "rows must be unit-stride"
    num_rows, hidden = x.shape
    assert hidden <= 65536, f"hidden {hidden} > 65536 is not supported"
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(out) if residual is not None else out
    if num_rows:
        block = triton.next_power_of_2(hidden)
        launchable(_rms_norm_kernel, x.device)[(num_rows,)](
            x, residual if residual is not None else x, weight, out, residual_out,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), residual_out.stride(0),
            eps,
            HIDDEN=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 256)),
        )
    return out if residual is None else (out, residual_out)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference, rounding as HF's LlamaRMSNorm does."""
    _check(x, weight, residual)
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)).to(x.dtype)
    return y if residual is None else (y, x)
