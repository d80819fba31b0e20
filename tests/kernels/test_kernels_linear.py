import pytest
import torch
import torch.nn.functional as F

from kernels.linear import Linear, linear, linear_ref


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    w = torch.randn(40, 96, generator=gen)
    b = torch.randn(40, generator=gen) if bias else None
    with torch.inference_mode():
        out = linear(x, w, b)
    ref = linear_ref(x.double(), w.double(), None if b is None else b.double())
    assert out.shape == (rows, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_linear_keeps_leading_dims_and_other_dtypes():
    x = torch.randn(2, 3, 16)
    w = torch.randn(8, 16)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        xb, wb = x.bfloat16(), w.bfloat16()
        assert torch.equal(linear(xb, wb), F.linear(xb, wb))  # not fp32: torch's own path


def test_linear_module_is_a_drop_in_nn_linear():
    torch.manual_seed(0)
    ours, theirs = Linear(16, 8, bias=True), torch.nn.Linear(16, 8, bias=True)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 16)
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    # with autograd on, it is exactly nn.Linear (oneDNN's op is inference-only here)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
