"""agentrt kernels: Triton kernels with pure-torch references, behind one dispatching API.

Ops (each module holds the kernel, its launcher `*_triton` and its reference `*_ref`):
`store_kv`, `paged_attention`, `copy_blocks`, `rms_norm`, `silu_and_mul`; plus `linear` (library GEMMs
or C++ packed kernels picked per device, dtype and row count, no Triton kernel) and `grouped_linear`
(a mixture of experts' projections, one GEMM per expert: C++ on CPU, torch elsewhere). `kernels.cpu` builds
the C++ CPU kernels (small-row linear, decode attention straight from the paged cache, fused norms,
RoPE with the cache write; fp32 and bf16) for the CPU it runs on; `kernels.paged_attention_cpu` is
paged attention's CPU production path. The dispatching functions exported here pick Triton for CUDA
tensors and the torch path on CPU; see `kernels._dispatch` for the backend switch.

Note: the op names here are the dispatching functions, which shadow the submodules of the same
name: reach a submodule with `from agentrt.kernels.<module> import ...`, not `import ... as m`.

Depends on torch and triton only (plus a C++ compiler for `kernels.cpu`, optional).
"""

if __name__ == "kernels":  # this folder, found by its folder name from a checkout: Hugging Face's name
    # Relative, so it needs nothing but the standard library: the interpreter (vLLM's, a notebook's) may
    # not have agentrt installed, and this folder is then no `agentrt.kernels`.
    from ._folder_name import hand_over

    hand_over()  # sys.modules["kernels"] is now the other package: nothing of this floor is loaded
else:
    from agentrt.kernels import cpu, gated_delta, moe, quant
    from agentrt.kernels._dispatch import (
        copy_blocks,
        get_backend,
        paged_attention,
        rms_norm,
        set_backend,
        silu_and_mul,
        store_kv,
        use_backend,
    )
    from agentrt.kernels.copy_blocks import copy_blocks_ref, copy_blocks_triton
    from agentrt.kernels.linear import Linear, linear, linear_ref
    from agentrt.kernels.moe import grouped_linear, grouped_linear_ref
    from agentrt.kernels.paged_attention import (
        AttentionMetadata,
        build_attention_metadata,
        dense_causal_attention_ref,
        paged_attention_ref,
        paged_attention_triton,
    )
    from agentrt.kernels.paged_attention_cpu import paged_attention_cpu
    from agentrt.kernels.rms_norm import rms_norm_ref, rms_norm_triton
    from agentrt.kernels.silu_and_mul import silu_and_mul_ref, silu_and_mul_triton
    from agentrt.kernels.store_kv import store_kv_ref, store_kv_triton

__all__ = [
    "AttentionMetadata",
    "Linear",
    "build_attention_metadata",
    "copy_blocks",
    "copy_blocks_ref",
    "copy_blocks_triton",
    "cpu",
    "dense_causal_attention_ref",
    "gated_delta",
    "get_backend",
    "grouped_linear",
    "grouped_linear_ref",
    "linear",
    "linear_ref",
    "moe",
    "paged_attention",
    "paged_attention_cpu",
    "paged_attention_ref",
    "paged_attention_triton",
    "quant",
    "rms_norm",
    "rms_norm_ref",
    "rms_norm_triton",
    "set_backend",
    "silu_and_mul",
    "silu_and_mul_ref",
    "silu_and_mul_triton",
    "store_kv",
    "store_kv_ref",
    "store_kv_triton",
    "use_backend",
]
