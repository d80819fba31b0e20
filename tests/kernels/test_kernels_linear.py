import pytest
import torch
import torch.nn.functional as F

from agentrt.kernels import cpu
from agentrt.kernels.linear import Linear, PackCache, linear, linear_ref, pack_linear_weight


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


needs_cpp = pytest.mark.skipif(not cpu.available(), reason="C++ CPU kernels cannot be built here")


@needs_cpp
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 64])  # every register-tile height, and more
@pytest.mark.parametrize(("n", "k"), [(40, 96), (13, 7), (130, 1536)])  # n not a multiple of the 16-row panels
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_reference(rows, n, k, bias):
    gen = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    cache = PackCache()
    with torch.inference_mode():
        out = linear(x, w, b, cache)
    assert cache.packed is not None and cache.packed.shape == (-(-n // 16), k, 16)  # the C++ path ran
    ref = linear_ref(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


@needs_cpp
def test_pack_cache_follows_weight_changes():
    """The packed copy is rebuilt after an in-place write or a new weight tensor, never stale."""
    lin = Linear(16, 12, bias=False)
    x = torch.randn(1, 16)
    with torch.inference_mode():
        first = lin(x)
        packed = lin.pack_cache.packed
        assert lin(x) is not None and lin.pack_cache.packed is packed  # reused while the weight is unchanged
    with torch.no_grad():
        lin.weight.mul_(2)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), 2 * first, rtol=1e-5, atol=1e-5)
        assert lin.pack_cache.packed is not packed
        lin.weight = torch.nn.Parameter(torch.zeros(12, 16))
        assert torch.equal(lin(x), torch.zeros(1, 12))


def test_linear_without_cpp_kernels_matches():
    x, w = torch.randn(3, 32), torch.randn(24, 32)
    with torch.inference_mode(), cpu.use_cpu_kernels(False):
        cache = PackCache()
        out = linear(x, w, None, cache)
        assert cache.packed is None
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_cpp
def test_packed_linear_rejects_bad_input():
    ops = cpu.ops()
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="packed weight"):
        ops.packed_linear(x, w, None, 8)  # not packed
    with pytest.raises(RuntimeError, match="fp32"):
        ops.packed_linear(x.double(), pack_linear_weight(w), None, 8)


def _vm_flags(ptr: int) -> set[str] | None:
    """The VmFlags of the mapping holding address `ptr` (Linux /proc/self/smaps), None if unreadable."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    return None


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="no madvise(MADV_HUGEPAGE) here")
def test_on_huge_pages_copies_into_one_huge_page_mapping():
    import gc

    from agentrt.kernels.linear import HUGE_PAGE, on_huge_pages

    gen = torch.Generator().manual_seed(0)
    src = [torch.randn(3, 70, 16, generator=gen), torch.randn(5, 9, generator=gen).bfloat16(),
           torch.arange(7, dtype=torch.int32), torch.randn(1, 1, generator=gen)]
    copies = on_huge_pages(src)
    for s, c in zip(src, copies, strict=True):
        assert torch.equal(s, c) and c.dtype == s.dtype and c.shape == s.shape and c.is_contiguous()
        assert c.data_ptr() != s.data_ptr() and c.data_ptr() % 4096 == 0
    assert copies[0].data_ptr() % HUGE_PAGE == 0  # starts on a 2 MB boundary
    flags = _vm_flags(copies[0].data_ptr())
    assert flags is None or "hg" in flags, flags  # advised for transparent huge pages
    src[0].zero_()  # copies, not views
    assert copies[0].abs().sum() > 0
    keep = copies[1].clone()
    del copies[0], src
    gc.collect()
    assert torch.equal(copies[0], keep)  # the mapping lives while any copy does
    assert on_huge_pages([]) == []


@needs_cpp
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_weights_are_moved_to_huge_pages(tiny_model_path, dtype):
    """After a decode step every packed weight the step streams (the LM head's too) lies on huge pages,
    and the engine's greedy output is what it was before the move (the first step)."""
    import mmap

    from agentrt.engine import LLM, SamplingParams

    llm = LLM(str(tiny_model_path), dtype=dtype, num_blocks=16, block_size=16)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    model = llm.core.model
    lins = [lin for layer in model.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                          layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    caches = [lin.pack_cache for lin in lins] + [model._tied_head_pack if model.lm_head is None
                                                 else model.lm_head.pack_cache]
    assert all(c.packed is not None for c in caches)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        for c in caches:
            flags = _vm_flags(c.packed.data_ptr())
            assert flags is None or "hg" in flags
    again = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    assert again == out
