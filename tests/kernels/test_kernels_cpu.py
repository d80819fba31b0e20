"""The C++ CPU kernels of every CPU kind this machine supports (forced one at a time), fp32 and bf16.

bf16 kernels follow the kernel rule against an fp32 reference on the same bf16 inputs:
err(kernel) <= 2 * err(torch in bf16) + atol, where torch in bf16 is what HF's bf16 model computes.
"""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from agentrt.kernels import (
    cpu,
    paged_attention_cpu,
    paged_attention_ref,
    rms_norm_ref,
    store_kv_ref,
)
from agentrt.kernels.linear import BF16_PACKED_MAX_ROWS, PackCache, linear, pack_linear_weight_bf16
from tests.paged_batch import make_paged_batch

ATOL_BF16 = 1e-6  # the bf16 rule's atol: the kernels are at least as close as torch, up to float noise


def check_rule(out: torch.Tensor, torch_same_dtype: torch.Tensor, gold: torch.Tensor, atol: float = ATOL_BF16) -> None:
    assert out.dtype == torch_same_dtype.dtype and out.shape == gold.shape
    assert not out.isnan().any()
    err = (out.double() - gold.double()).abs().max().item()
    err_torch = (torch_same_dtype.double() - gold.double()).abs().max().item()
    assert err <= 2 * err_torch + atol, f"err {err:.3g} vs torch {err_torch:.3g}"


def test_kind_is_compiled_for(cpu_kind):
    # a compiler without AVX512-BF16 support builds that kind without it (and says so)
    built_as = cpu.ops().isa()
    assert cpu.kind() == cpu_kind and cpu.compiled_isa() == built_as
    assert built_as == cpu_kind or (cpu_kind, built_as) == ("avx512_bf16", "avx512")
    assert cpu.describe() == f"C++ {built_as}" + (" + AMX" if cpu.amx() else "")
    assert not cpu.amx() or built_as == "avx512_bf16"  # AMX only in the kind built with AVX512-BF16


def test_kinds_of_this_cpu():
    kinds = cpu.supported_kinds()
    assert kinds and set(kinds) <= set(cpu.KINDS) and cpu.native_kind() == kinds[0]
    assert ("avx512_bf16" in kinds) == ("avx512_bf16" in cpu.cpu_flags())


def test_unsupported_or_unknown_kind_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="'sse9'"), cpu.use_kind("sse9"):
        pass
    monkeypatch.setenv(cpu.ISA_ENV_VAR, "sse9")
    monkeypatch.setitem(cpu._state, "env_kind", None)  # read again
    with pytest.raises(ValueError, match="AGENTRT_CPU_ISA"):
        cpu.kind()
    missing = [k for k in cpu.KINDS if k not in cpu.supported_kinds()]
    if missing:
        with pytest.raises(ValueError, match="this CPU supports"):
            cpu.ops(missing[0])


def test_a_killed_build_does_not_stall_the_next_process(cpu_kind):
    # torch's build baton (`lock`) outlives a build killed half-way (Ctrl-C, a restarted machine); torch alone
    # would wait on it forever, in every later process, even with the library already built
    build_dir = cpu.build_directory(cpu_kind)
    assert cpu.library_path(cpu_kind).exists()
    (build_dir / "lock").touch()
    code = f"from agentrt.kernels import cpu; print(cpu.available({cpu_kind!r}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr[-2000:]  # in time: torch alone would wait out the timeout


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 12, 13, 30, 64, 100])  # every tile height of each kind, and more
@pytest.mark.parametrize(("n", "k"), [(40, 96), (13, 7), (96, 577)])  # n not a multiple of 32, odd k
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_bf16(cpu_kind, rows, n, k, bias):
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    cache = PackCache()
    with torch.inference_mode():
        out = linear(x, w, b, cache)
        # the kernel itself at every row count, also where `linear` gives these rows to the library's GEMM
        direct = cpu.ops().packed_linear_bf16(x, pack_linear_weight_bf16(w), None if b is None else b.float(), n)
    packed_rows = rows <= BF16_PACKED_MAX_ROWS or cpu.compiled_isa() != "avx512_bf16"
    if packed_rows:  # the C++ path ran
        assert cache.packed is not None and cache.packed.shape == (-(-n // 32), -(-k // 2), 32, 2)
        assert torch.equal(out, direct)
    else:
        assert cache.packed is None
    gold = F.linear(x.double(), w.double(), None if b is None else b.double())
    check_rule(out, F.linear(x, w, b), gold)
    check_rule(direct, F.linear(x, w, b), gold)


def test_packed_linear_bf16_layout_and_rejects_bad_input(cpu_kind):
    w = torch.arange(6 * 3, dtype=torch.float32).view(6, 3).bfloat16()
    packed = pack_linear_weight_bf16(w)
    assert packed.shape == (1, 2, 32, 2)
    assert packed[0, 0, 1].tolist() == [3, 4] and packed[0, 1, 1].tolist() == [5, 0]  # row 1, k pairs (0,1), (2, pad)
    assert packed[0, :, 6:].abs().sum() == 0  # rows past N
    ops = cpu.ops()
    with pytest.raises(RuntimeError, match="packed weight"):
        ops.packed_linear_bf16(torch.randn(2, 3).bfloat16(), w, None, 6)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.packed_linear_bf16(torch.randn(2, 3), packed, None, 6)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_fp32(cpu_kind, rows):
    gen = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 100, generator=gen), torch.randn(50, 100, generator=gen), torch.randn(50, generator=gen)
    with torch.inference_mode():
        out = linear(x, w, b, PackCache())
    torch.testing.assert_close(out.double(), F.linear(x.double(), w.double(), b.double()), rtol=1e-5, atol=1e-4)


def test_bf16_rows_past_the_packed_kernel(cpu_kind):
    """More rows than BF16_PACKED_MAX_ROWS take the library's GEMM where the kernels have AVX512-BF16's dot
    products, and the packed kernel (panels widened to fp32) where they do not."""
    x, w = torch.randn(BF16_PACKED_MAX_ROWS + 1, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    cache = PackCache()
    with torch.inference_mode():
        out = linear(x, w, None, cache)
    if cpu.compiled_isa() == "avx512_bf16":
        assert cache.packed is None and torch.equal(out, F.linear(x, w))
    else:
        assert cache.packed is not None
        check_rule(out, F.linear(x, w), F.linear(x.double(), w.double()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_lens", "seq_lens"), [
    ([1, 1, 1], [1, 45, 300]),  # decode
    ([1, 5, 16, 17], [33, 17, 70, 40]),  # decode, drafts, one prefill chunk over cached context
    ([130, 33, 1, 70], [130, 100, 9, 70]),  # prefill: fresh prompts and a chunk after 67 cached positions
])
@pytest.mark.parametrize(("heads", "head_dim"), [((9, 3), 64), ((8, 1), 128), ((4, 4), 32)])
def test_paged_attention(cpu_kind, dtype, q_lens, seq_lens, heads, head_dim):
    """Rows of up to 16 per sequence from the paged cache in C++; longer ones through the C++ prefill
    kernel in bf16 on AVX512-BF16, SDPA otherwise; in bf16 the cache is read as bf16."""
    batch = make_paged_batch(q_lens, seq_lens, *heads, head_dim, 16, dtype, seed=len(q_lens) + head_dim)
    scale = head_dim ** -0.5
    out = paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)
    plan = batch.meta._cpu_plan
    assert plan.use_cpp and plan.tiled == (dtype == torch.bfloat16 and cpu.compiled_isa() == "avx512_bf16")
    gold = batch.dense(scale)  # fp32 math on the same (bf16-valued) inputs
    if dtype == torch.float32:
        torch.testing.assert_close(out, gold, rtol=1e-5, atol=1e-5)
    else:
        check_rule(out, paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale), gold)


def test_paged_attention_reference_matches_dense():
    batch = make_paged_batch([1, 5, 0, 20], [33, 17, 9, 40], 9, 3, 64, 16, torch.float32, seed=7)
    out = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    torch.testing.assert_close(out, batch.dense(0.125), rtol=1e-5, atol=1e-5)


def hf_rms_norm(x, w, eps):
    """HF LlamaRMSNorm in x's dtype."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (5, 13), (33, 1536)])
def test_rms_norms(cpu_kind, rows, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x32, r32 = 3 * torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    w32 = 1 + 0.2 * torch.randn(hidden, generator=gen)
    ops = cpu.ops()
    torch.testing.assert_close(ops.rms_norm(x32, w32, 1e-5), rms_norm_ref(x32, w32, 1e-5), rtol=1e-5, atol=1e-5)
    y, s = ops.add_rms_norm(x32, r32, w32, 1e-5)
    torch.testing.assert_close(s, x32 + r32, rtol=0, atol=0)
    torch.testing.assert_close(y, rms_norm_ref(x32 + r32, w32, 1e-5), rtol=1e-5, atol=1e-5)
    x, r, w = x32.bfloat16(), r32.bfloat16(), w32.bfloat16()
    gold = rms_norm_ref(x.double(), w.double(), 1e-5)
    out = ops.rms_norm(x, w, 1e-5)
    check_rule(out, hf_rms_norm(x, w, 1e-5), gold)
    assert (out.float() - hf_rms_norm(x, w, 1e-5).float()).abs().max() <= 2 ** -7 * out.float().abs().max()
    y, s = ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r)  # the residual stream rounded to bf16, as HF's bf16 add
    check_rule(y, hf_rms_norm(x + r, w, 1e-5), rms_norm_ref((x + r).double(), w.double(), 1e-5))


@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (5, 13)])
def test_silu_and_mul(cpu_kind, rows, inter):
    gen = torch.Generator().manual_seed(inter)
    x32 = 5 * torch.randn(rows, 2 * inter, generator=gen)
    x32[0, 0], x32[0, 1] = -200.0, 200.0  # exp clamps: silu(-200) ~ 0, silu(200) = 200
    ops = cpu.ops()
    gate, up = x32.double().chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x32).double(), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    x = x32.bfloat16()
    g, u = x.chunk(2, dim=-1)
    check_rule(ops.silu_and_mul(x), F.silu(g) * u, F.silu(g.double()) * u.double())


def rope_ref(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """HF's `q * cos + rotate_half(q) * sin` in x's dtype, in the adjacent-pair layout. x: [T, heads, D]."""
    cs = cos_sin[positions].to(x.dtype)  # [T, D/2, 2]
    cos, sin = cs[..., 0].repeat_interleave(2, -1)[:, None], cs[..., 1].repeat_interleave(2, -1)[:, None]
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], -1).flatten(-2)
    return x * cos + rotated * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv(cpu_kind, dtype):
    H, KVH, D, T, BS, blocks = 9, 3, 64, 7, 4, 6
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, (H + 2 * KVH) * D + 5, generator=gen).to(dtype)[:, 5:]  # a strided view, as a bias-free slice
    positions = torch.tensor([0, 1, 2, 30, 31, 99, 5])
    angles = torch.outer(torch.arange(128, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, D, 2) / D))
    cos_sin = torch.stack([angles.cos(), angles.sin()], -1).contiguous()  # [128, D/2, 2]
    slots = torch.tensor([3, 0, 17, -1, 22, 8, 9])
    k_cache = torch.full((blocks, BS, KVH, D), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    q = cpu.ops().rope_store_kv(qkv, positions, cos_sin, k_cache, v_cache, slots, H)
    heads = qkv.reshape(T, H + 2 * KVH, D)
    want = rope_ref(heads[:, : H + KVH], cos_sin, positions)
    gold = rope_ref(heads[:, : H + KVH].double(), cos_sin.double(), positions)
    k_want, v_want = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan"))
    store_kv_ref(want[:, H:], heads[:, H + KVH:], k_want, v_want, slots)
    if dtype == torch.float32:
        torch.testing.assert_close(q, want[:, :H], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k_cache, k_want, rtol=1e-5, atol=1e-5, equal_nan=True)
    else:
        assert torch.equal(q, want[:, :H])  # bf16: rounded exactly where HF rounds
        assert torch.equal(k_cache.isnan(), k_want.isnan())
        assert torch.equal(k_cache.nan_to_num(), k_want.nan_to_num())
        check_rule(q, want[:, :H], gold[:, :H])
    assert torch.equal(v_cache.nan_to_num(), v_want.nan_to_num())  # values copied as they are
    with pytest.raises(RuntimeError, match="position 200"):
        cpu.ops().rope_store_kv(qkv, torch.full((T,), 200), cos_sin, k_cache, v_cache, slots, H)


@pytest.mark.parametrize("block_size", [4, 32])
def test_tiled_bf16_attention_block_sizes(block_size):
    """The AVX512-BF16 tiled kernel: packing 16 positions at a time over blocks smaller and larger than that."""
    if cpu.compiled_isa() != "avx512_bf16":
        pytest.skip("needs the avx512_bf16 kernels")
    batch = make_paged_batch([1, 7, 90], [61, 7, 200], 8, 2, 64, block_size, torch.bfloat16, seed=block_size)
    out = paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    assert batch.meta._cpu_plan.tiled
    check_rule(out, paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125), batch.dense(0.125))


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize(("q_lens", "seq_lens", "heads", "head_dim", "block_size"), [
    ([1], [300], (9, 3), 64, 16),  # one decode row: split in parts across threads, read from the cache as it lies
    ([1], [517], (9, 3), 64, 4),  # chunks straddling small blocks, a last part not a whole tile
    ([2], [150], (4, 2), 64, 16),  # one register tile of rows at two positions (4 = the tile's rows)
    ([1], [77], (8, 4), 128, 8),  # head_dim 128: 2 rows per tile, 4 vectors per K row
    ([1], [45], (2, 1), 256, 2),  # head_dim 256 (8 vectors per K row), blocks of 2
    ([3], [333], (8, 1), 128, 32),  # one kv head: up to 4 parts; 24 rows per head pack the part whole
    ([16], [200], (9, 3), 64, 16),  # drafts: every part starts at or before the first row's position
    ([16], [130], (9, 3), 64, 16),  # too short to split
    ([1, 1], [250, 40], (4, 4), 32, 16),  # 8 items: no split with 4 threads or fewer
    ([1, 2], [700, 300], (9, 3), 64, 16),  # two sequences, decode and drafts
])
def test_tiled_bf16_attention_split_and_tile_walks(threads, q_lens, seq_lens, heads, head_dim, block_size):
    """Decode-sized work of the AVX512-BF16 kernel: rows that fit one register tile read K/V straight
    from the cache (walk_direct); few items are split across threads by positions and merged; each
    way against the fp32 reference by the kernel rule, with 1, 2 and 4 threads."""
    if cpu.compiled_isa() != "avx512_bf16":
        pytest.skip("needs the avx512_bf16 kernels")
    batch = make_paged_batch(q_lens, seq_lens, *heads, head_dim, block_size, torch.bfloat16, seed=sum(seq_lens))
    scale = head_dim ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)
    finally:
        torch.set_num_threads(before)
    assert batch.meta._cpu_plan.tiled
    check_rule(out, paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale), batch.dense(scale))


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_lens", "seq_lens", "heads", "head_dim", "block_size"), [
    ([1], [300], (9, 3), 64, 16),  # one decode sequence: its positions split in parts of all kv heads
    ([1], [129], (9, 3), 64, 2),  # blocks of 2: part boundaries on block boundaries
    ([16], [200], (9, 3), 64, 16),  # drafts: every part starts at or before the first row's position
    ([16], [143], (8, 1), 128, 32),  # a part of one block past the first row's position
    ([1], [100], (4, 4), 32, 16),  # too short for parts: split by kv heads
    ([1, 3], [700, 64], (9, 3), 64, 16),  # one sequence split, one by kv heads
    ([1, 1, 1, 1], [90, 300, 5, 257], (9, 3), 64, 16),  # 4 sequences: whole ones or parts, by thread count
    ([1, 1, 1], [300, 300, 300], (9, 3), 64, 16),  # 3 even sequences on 2 threads: parts, balanced
    ([1, 4, 1], [1000, 100, 7], (8, 2), 128, 16),  # one long, two short: the long one in parts
    ([1] * 9, [40 * k + 3 for k in range(9)], (9, 3), 64, 16),  # many sequences: whole ones (up to 2 threads)
])
def test_small_q_attention_splits_across_threads(cpu_kind, threads, dtype, q_lens, seq_lens, heads, head_dim,
                                                 block_size):
    """paged_attention_small_q (fp32, and bf16 on any CPU) with fewer sequences than threads splits each
    sequence's positions across the threads and merges the parts; against fp32 dense attention, with
    1, 2 and 4 threads (the same parts merge to the same result as one walk)."""
    batch = make_paged_batch(q_lens, seq_lens, *heads, head_dim, block_size, dtype, seed=sum(seq_lens) + block_size)
    scale = head_dim ** -0.5
    m = batch.meta
    out = torch.full_like(batch.q, float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu.ops().paged_attention_small_q(batch.q, batch.k_cache, batch.v_cache, m.query_start_loc, m.seq_lens,
                                          m.block_tables, torch.arange(len(q_lens)), scale, out)
    finally:
        torch.set_num_threads(before)
    gold = batch.dense(scale)
    if dtype == torch.float32:
        torch.testing.assert_close(out, gold, rtol=1e-5, atol=1e-5)
    else:
        check_rule(out, paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale), gold)


def test_every_source_file_ships_with_the_package():
    """A non-editable install builds kernels/csrc from the package's own copy: every source and header
    there must match a package-data pattern of pyproject.toml."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(cpu.__file__).parent
    patterns = tomllib.loads((root.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["agentrt.kernels"]
    sources = sorted(p.relative_to(root).as_posix() for p in (root / "csrc").iterdir() if p.is_file())
    assert any(s.endswith(".h") for s in sources) and any(s.endswith(".cpp") for s in sources)
    missing = [s for s in sources if not any(fnmatch.fnmatch(s, pat) for pat in patterns)]
    assert not missing, f"kernels/csrc files not shipped with the package: {missing}"


def test_amx_is_the_bf16_projection_where_the_cpu_has_it_and_can_be_turned_off(cpu_kind):
    """The bf16 projections run on AMX by default where it exists (an AMX CPU, the avx512_bf16 kind); the
    start-up line says so; AGENTRT_CPU_AMX=0 keeps them on the AVX512-BF16 / AVX2 tiles. Each in its own process
    (the choice is made once per process)."""
    import os

    code = "from agentrt.kernels import cpu; print(cpu.amx()); print(cpu.describe())"
    env = {**os.environ, cpu.ISA_ENV_VAR: cpu_kind}
    runs = {}
    procs = {amx: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env={**env, "AGENTRT_CPU_AMX": amx})
             for amx in ("1", "0")}  # the two processes at once (each is mostly its imports, ~2 s)
    for amx, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        runs[amx] = out.split("\n")
    expected = "amx_bf16" in cpu.cpu_flags() and cpu_kind == "avx512_bf16"
    assert runs["1"][:2] == [str(expected), f"C++ {cpu_kind}" + (" + AMX" if expected else "")]
    assert runs["0"][:2] == ["False", f"C++ {cpu_kind}"]
