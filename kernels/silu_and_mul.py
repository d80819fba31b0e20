"""silu_and_mul: the gated MLP activation, `silu(x[:, :I]) * x[:, I:]` for x = [gate | up] of width 2I.

Rounding follows HF Llama: silu(gate) is rounded to the input dtype before the product.
Algorithm: grid (row, column block); fp32 math. Memory traffic: reads T * 2I, writes T * I.
Limits: x unit-stride along its last dim (any row stride).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from agentrt.kernels._common import launchable


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g * tl.sigmoid(g)).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def _check(x: torch.Tensor) -> None:
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2 * intermediate], got {tuple(x.shape)}"


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton launcher. x: [T, 2I] -> [T, I]."""
    _check(x)
    assert x.stride(1) == 1, "x must be unit-stride along its last dim"
    num_rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    if num_rows:
        block = min(1024, triton.next_power_of_2(inter))
        launchable(_silu_and_mul_kernel, x.device)[(num_rows, triton.cdiv(inter, block))](
            x, out, x.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=4)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Pure-torch reference."""
    _check(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
