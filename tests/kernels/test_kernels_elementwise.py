"""rms_norm (with and without the fused residual add) and silu_and_mul against their references."""

import pytest
import torch

from agentrt import kernels
from agentrt.kernels import cpu, rms_norm_ref, rms_norm_triton, silu_and_mul_ref, silu_and_mul_triton

# The interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest even), so bf16 results
# may sit one bf16 ulp (2^-7 relative; values here reach ~4) from torch's.
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 6e-2}


def check_rule(out: torch.Tensor, same_dtype: torch.Tensor, gold: torch.Tensor) -> None:
    """err(kernel) <= 2 * err(torch same dtype) + atol, errors against the fp32 reference."""
    err = (out.float() - gold.float()).abs().max().item()
    err_torch = (same_dtype.float() - gold.float()).abs().max().item()
    assert err <= 2 * err_torch + ATOL[out.dtype], f"err {err:.3g} vs torch {err_torch:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual):
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 2 * hidden, generator=gen).to(dtype)
    x = rows[:, :hidden]  # strided rows
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    residual = torch.randn(7, hidden, generator=gen).to(dtype) if with_residual else None
    out = rms_norm_triton(x, weight, 1e-5, residual)
    same = rms_norm_ref(x, weight, 1e-5, residual)
    gold = rms_norm_ref(x.float(), weight.float(), 1e-5, residual.float() if with_residual else None)
    if with_residual:
        # The new residual is the same rounded sum (up to the interpreter's bf16 truncation).
        torch.testing.assert_close(out[1], same[1], rtol=2 ** -7 if dtype == torch.bfloat16 else 0, atol=0)
        out, same, gold = out[0], same[0], gold[0]
    assert out.dtype == dtype and out.shape == x.shape
    check_rule(out, same, gold)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inter", [96, 1536])
def test_silu_and_mul(dtype, inter):
    x = torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = silu_and_mul_triton(x)
    assert out.shape == (5, inter) and out.dtype == dtype
    check_rule(out, silu_and_mul_ref(x), silu_and_mul_ref(x.float()))


def test_dispatched_elementwise_ops():
    x = torch.randn(3, 128)
    weight = torch.ones(64)
    for backend in ("torch", "triton"):
        with kernels.use_backend(backend):
            torch.testing.assert_close(kernels.silu_and_mul(x), silu_and_mul_ref(x))
            y, s = kernels.rms_norm(x[:, :64], weight, 1e-6, x[:, 64:])
            torch.testing.assert_close(y, rms_norm_ref(x[:, :64] + x[:, 64:], weight, 1e-6))
            torch.testing.assert_close(s, x[:, :64] + x[:, 64:])


@pytest.mark.skipif(not cpu.available(), reason="C++ CPU kernels cannot be built here")
@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (5, 13), (33, 1536)])  # hidden not a multiple of 8 too
def test_cpp_rms_norm_and_silu_and_mul(rows, hidden):
    """The C++ CPU ops the model uses in fp32 match torch in float64, extreme gate values included."""
    gen = torch.Generator().manual_seed(hidden)
    x = 3 * torch.randn(rows, hidden, generator=gen)
    w = torch.randn(hidden, generator=gen)
    ref = torch.nn.functional.rms_norm(x.double(), (hidden,), w.double(), 1e-5)
    torch.testing.assert_close(cpu.ops().rms_norm(x, w, 1e-5).double(), ref, rtol=1e-5, atol=1e-5)
    gate_up = 5 * torch.randn(rows, 2 * hidden, generator=gen)
    gate_up[0, 0], gate_up[0, 1] = -200.0, 200.0  # exp clamps: silu(-200) ~ 0, silu(200) = 200
    gate, up = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(cpu.ops().silu_and_mul(gate_up).double(), torch.nn.functional.silu(gate) * up,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        cpu.ops().silu_and_mul(gate_up[:, :-1])  # odd width
