"""The kernels compile for a real GPU (sm_90) without one: catches what the interpreter forgives.

The interpreter runs kernels as numpy code, so type errors, bad `tl.dot` shapes or unsupported
control flow would first show on a GPU. Triton ships ptxas, so compiling ahead of time needs none.
Compiling must happen in a process without TRITON_INTERPRET (triton's own library functions are
decorated differently under it), so the test runs this file as a script.
"""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# (dtype, head_dim, BLOCK_M, SPLIT_K, SOFTCAP, HAS_SINKS): prefill at Llama-3-8B's head dim, split-K decode, SmolLM
# decode; gpt-oss's split-K decode with sinks (head dim 64), Gemma 2's soft-capped prefill (head dim 256).
PAGED_ATTENTION_VARIANTS = [("bf16", 128, 64, False, False, False), ("bf16", 128, 16, True, False, False),
                            ("fp16", 64, 16, False, False, False), ("bf16", 64, 16, True, False, True),
                            ("bf16", 256, 32, False, True, False)]


def compile_sm90(kernel, pointer_types: dict[str, str], constexprs: dict[str, object], **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(kernel.fn).parameters)
    signature = {p: "constexpr" if p in constexprs else pointer_types.get(p, "i32") for p in params}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(params.index(name),): value for name, value in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["cubin"]
    print(f"compiled {kernel.fn.__name__} {constexprs}: {compiled.metadata.shared} B shared memory")


def compile_all() -> None:
    import triton.language as tl

    from agentrt.kernels.copy_blocks import _copy_blocks_kernel
    from agentrt.kernels.paged_attention import _merge_splits_kernel, _paged_attention_kernel
    from agentrt.kernels.rms_norm import _rms_norm_kernel
    from agentrt.kernels.silu_and_mul import _silu_and_mul_kernel
    from agentrt.kernels.store_kv import _store_kv_kernel

    for dtype, head_dim, block_m, split_k, softcap, sinks in PAGED_ATTENTION_VARIANTS:
        pointer = f"*{dtype}"
        types = dict(q_ptr=pointer, k_cache_ptr=pointer, v_cache_ptr=pointer, out_ptr="*fp32" if split_k else pointer,
                     lse_ptr="*fp32", query_start_loc_ptr="*i32", seq_lens_ptr="*i32", block_tables_ptr="*i32",
                     tile_start_loc_ptr="*i32", sinks_ptr="*fp32",
                     qk_scale="fp32", softcap="fp32")
        compile_sm90(_paged_attention_kernel, types, dict(
            GROUP=4, HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim, PAGE_SIZE=16, BLOCK_M=block_m, BLOCK_N=64, SEQS_P2=64,
            SPLIT_K=split_k, DOT_DTYPE=tl.bfloat16 if dtype == "bf16" else tl.float16, DOT_PRECISION="tf32",
            SOFTCAP=softcap, HAS_SINKS=sinks,
        ), num_warps=4, num_stages=2)
    for sinks in (False, True):
        compile_sm90(_merge_splits_kernel, dict(part_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16", sinks_ptr="*fp32"),
                     dict(HEAD_DIM=128, HEAD_DIM_P2=128, SPLITS_P2=32, HAS_SINKS=sinks), num_warps=2)
    compile_sm90(_store_kv_kernel, dict(key_ptr="*bf16", value_ptr="*bf16", k_cache_ptr="*bf16",
                                        v_cache_ptr="*bf16", slot_mapping_ptr="*i64"),
                 dict(NUM_KV_HEADS=3, HEAD_DIM=64, BLOCK_SIZE=16, HEADS_P2=4, HEAD_DIM_P2=64), num_warps=1)
    compile_sm90(_copy_blocks_kernel, dict(cache_ptr="*bf16", mapping_ptr="*i64"),
                 dict(BLOCK_NUMEL=16384, CHUNK=2048), num_warps=4)
    compile_sm90(_rms_norm_kernel, dict(x_ptr="*bf16", residual_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16",
                                        residual_out_ptr="*bf16", eps="fp32"),
                 dict(HIDDEN=4096, BLOCK=4096, HAS_RESIDUAL=True), num_warps=16)
    compile_sm90(_silu_and_mul_kernel, dict(x_ptr="*bf16", out_ptr="*bf16"), dict(INTER=14336, BLOCK=1024),
                 num_warps=4)


def test_kernels_compile_for_sm90():
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(90)
    except Exception as exc:  # noqa: BLE001 - any missing piece of the toolchain: cannot check here
        pytest.skip(f"no NVIDIA Triton toolchain: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run([sys.executable, __file__], env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.count("compiled ") == len(PAGED_ATTENTION_VARIANTS) + 6


if __name__ == "__main__":
    compile_all()
