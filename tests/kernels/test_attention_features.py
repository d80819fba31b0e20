"""A layer's attention features (sliding window, sinks, soft-capping) on every path of `paged_attention`:
the Triton kernel (interpreter), the C++ CPU kernel of decode rows, the torch path, and the reference,
each against dense fp32 attention written out (`dense_causal_attention_ref`) on the same inputs.
Irregular shapes: lengths not multiples of the block, GQA groups of 1 and 3, odd windows, decode rows
whose windows start mid-block, sequences long enough for the C++ kernel to split their positions."""

import pytest
import torch

from agentrt import kernels
from agentrt.kernels import cpu, dense_causal_attention_ref, paged_attention_cpu, paged_attention_ref
from agentrt.kernels.paged_attention import paged_attention_triton
from tests.paged_batch import PagedBatch, make_paged_batch

FEATURES = {  # name -> (window, with sinks, softcap)
    "window": (13, False, None),
    "window8-sinks": (8, True, None),
    "sinks": (None, True, None),
    "softcap": (None, False, 5.0),
    "all": (11, True, 3.0),
}


def _sinks(H: int, seed: int) -> torch.Tensor:
    return torch.randn(H, generator=torch.Generator().manual_seed(seed)) * 2


def _dense(batch: PagedBatch, scale: float, window, sinks, softcap, dtype=torch.float32) -> torch.Tensor:
    qsl = batch.query_start_loc
    return torch.cat([dense_causal_attention_ref(batch.q[qsl[b]:qsl[b + 1]].to(dtype), batch.keys[b].to(dtype),
                                                 batch.values[b].to(dtype), scale, window=window or 0,
                                                 sinks=sinks, softcap=softcap or 0.0)
                      for b in range(len(batch.keys))])


def _nmse(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(((a - b) ** 2).sum() / (b**2).sum())


MIXED = ([1, 21, 3, 5], [37, 21, 19, 40])  # decode, fresh prompt, draft rows, prefill chunk over context


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize(("H", "KVH"), [(4, 4), (6, 2)])
def test_reference_and_torch_path(feature, H, KVH):
    window, with_sinks, softcap = FEATURES[feature]
    batch = make_paged_batch(*MIXED, H, KVH, 32, 4, torch.float32, seed=H)
    sinks = _sinks(H, 1) if with_sinks else None
    scale = 32**-0.5
    gold = _dense(batch, scale, window, sinks, softcap)
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window=window, sinks=sinks,
                              softcap=softcap)
    torch.testing.assert_close(ref, gold, rtol=1e-5, atol=1e-5)
    with cpu.use_cpu_kernels(False):
        out = paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window=window,
                                  sinks=sinks, softcap=softcap)
    torch.testing.assert_close(out, gold, rtol=1e-5, atol=1e-5)


def test_window_changes_the_output():
    # the feature is not a no-op: a window shorter than the context differs from full attention
    batch = make_paged_batch([1], [40], 4, 2, 32, 4, torch.float32)
    full = _dense(batch, 0.2, None, None, None)
    assert not torch.allclose(_dense(batch, 0.2, 8, None, None), full)
    assert torch.allclose(_dense(batch, 0.2, 40, None, None), full)  # a window covering everything: none


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize(("H", "KVH", "D"), [(4, 4, 32), (6, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_kernel(feature, H, KVH, D, dtype):
    if not cpu.available():
        pytest.skip("C++ CPU kernels cannot be built here")
    window, with_sinks, softcap = FEATURES[feature]
    # decode rows with short and long contexts (the long ones split across threads), draft rows, a prefill
    # chunk (the torch path inside the same call)
    batch = make_paged_batch([1, 1, 1, 4, 30], [300, 9, 157, 29, 45], H, KVH, D, 16, dtype, seed=D)
    sinks = _sinks(H, 2) if with_sinks else None
    scale = D**-0.5
    gold = _dense(batch, scale, window, sinks, softcap)
    out = paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window=window, sinks=sinks,
                              softcap=softcap)
    assert not out.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(out, gold, rtol=1e-5, atol=1e-5)
    else:  # the kernel rule: at most twice torch's own bf16 error, plus float noise
        same = _dense(batch, scale, window, sinks, softcap, dtype=torch.bfloat16)
        err = (out.double() - gold.double()).abs().max().item()
        assert err <= 2 * (same.double() - gold.double()).abs().max().item() + 1e-2


@pytest.mark.parametrize("window", [16, 100, 200])  # windows within one part, across kv-head items, across parts
def test_cpp_decode_window_on_split_sequences(window):
    if not cpu.available():
        pytest.skip("C++ CPU kernels cannot be built here")
    batch = make_paged_batch([1], [613], 8, 2, 64, 16, torch.float32, seed=window)
    sinks = _sinks(8, 3)
    gold = _dense(batch, 0.125, window, sinks, None)
    for invariant in (False, True):
        batch.meta.batch_invariant = invariant
        batch.meta._cpu_plan = None
        out = paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, window=window, sinks=sinks)
        torch.testing.assert_close(out, gold, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("window", [1, 5, 32, 45, 100, 1000])
@pytest.mark.parametrize(("H", "KVH", "D", "block_size"), [(4, 1, 256, 16), (6, 2, 64, 4), (8, 2, 128, 32)])
def test_tiled_bf16_kernel_takes_a_window(threads, window, H, KVH, D, block_size):
    """A window alone goes to the AVX512-BF16 tiled kernel (Gemma 3's local layers): decode rows (short and long
    contexts, split across threads when not batch-invariant), drafts, prefill chunks over a context and fresh
    prompts (packed whole), windows shorter than a tile, starting mid-tile and mid-block, and longer than every
    context; against dense fp32 attention with the window by the kernel rule, both modes, 1, 2 and 4 threads."""
    if cpu.compiled_isa() != "avx512_bf16":
        pytest.skip("needs the avx512_bf16 kernels")
    batch = make_paged_batch([1, 1, 5, 40, 70, 1], [300, 9, 157, 120, 70, 613], H, KVH, D, block_size,
                             torch.bfloat16, seed=window + D)
    scale = D**-0.5
    gold, same = (_dense(batch, scale, window, None, None, dtype=d) for d in (torch.float32, torch.bfloat16))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for invariant in (False, True):
            batch.meta.batch_invariant = invariant
            batch.meta._cpu_plan = None
            out = paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window=window)
            assert batch.meta._cpu_plan.tiled
            assert not out.isnan().any()
            err = (out.double() - gold.double()).abs().max().item()
            assert err <= 2 * (same.double() - gold.double()).abs().max().item() + 1e-2, (invariant, err)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize(("H", "KVH"), [(4, 4), (6, 2)])
def test_triton_kernel(feature, H, KVH):
    window, with_sinks, softcap = FEATURES[feature]
    batch = make_paged_batch(*MIXED, H, KVH, 32, 4, torch.float32, seed=H + 1)
    sinks = _sinks(H, 4) if with_sinks else None
    gold = _dense(batch, 0.3, window, sinks, softcap)
    out = paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.3, window=window, sinks=sinks,
                                 softcap=softcap)
    assert _nmse(out, gold) < 1e-10
    torch.testing.assert_close(out, gold, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 7, 50])
def test_triton_split_k_decode(window):
    # flash-decoding slices: the window starts the first slice, the sinks join in the merge
    batch = make_paged_batch([1, 1], [83, 61], 6, 2, 32, 4, torch.float32, seed=5)
    sinks = _sinks(6, 6)
    gold = _dense(batch, 0.2, window, sinks, None)
    out = paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2, window=window, sinks=sinks,
                                 num_splits=3)
    torch.testing.assert_close(out, gold, rtol=1e-4, atol=1e-4)


def test_dispatch_passes_features_and_checks_them():
    batch = make_paged_batch([2], [20], 4, 2, 32, 4, torch.float32)
    gold = _dense(batch, 0.2, 5, None, 2.0)
    with kernels.use_backend("torch"):
        out = kernels.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2, window=5, softcap=2.0)
    torch.testing.assert_close(out, gold, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="window must be a positive"):
        kernels.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2, window=0)
    with pytest.raises(ValueError, match=r"sinks must be \[num_heads=4\]"):
        kernels.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="softcap must be positive"):
        kernels.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2, softcap=-1.0)
