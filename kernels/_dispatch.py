"""Backend selection: which implementation the public ops run.

- "auto" (default): Triton for CUDA tensors, the torch reference otherwise (for paged attention, the
  CPU production path `paged_attention_cpu`: C++ on CPU, pure torch elsewhere).
- "triton": always Triton; on CPU tensors that means the Triton interpreter (TRITON_INTERPRET=1).
- "torch": always the torch reference (`paged_attention_cpu` for paged attention).

Chosen by `set_backend(name)`, the context manager `use_backend(name)`, or the environment variable
AGENTRT_KERNEL_BACKEND (read on first use). The setting is process-wide, not per thread: the engine
runs its steps in a worker thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from agentrt.kernels.copy_blocks import copy_blocks_ref, copy_blocks_triton
from agentrt.kernels.paged_attention import AttentionMetadata, paged_attention_triton
from agentrt.kernels.paged_attention_cpu import paged_attention_cpu
from agentrt.kernels.rms_norm import rms_norm_ref, rms_norm_triton
from agentrt.kernels.silu_and_mul import silu_and_mul_ref, silu_and_mul_triton
from agentrt.kernels.store_kv import store_kv_ref, store_kv_triton

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "AGENTRT_KERNEL_BACKEND"

_backend: str | None = None  # None: not chosen yet, read ENV_VAR on first use


def _validated(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r} ({source}); expected one of {', '.join(BACKENDS)}")
    return name


def get_backend() -> str:
    """The current backend name."""
    global _backend
    if _backend is None:
        _backend = _validated(os.environ.get(ENV_VAR, "auto"), f"environment variable {ENV_VAR}")
    return _backend


def set_backend(name: str) -> None:
    """Select the backend for all later calls: "auto", "triton" or "torch"."""
    global _backend
    _backend = _validated(name, "set_backend")


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Select the backend inside a `with` block, restoring the previous one after it."""
    global _backend
    previous = _backend
    _backend = _validated(name, "use_backend")
    try:
        yield
    finally:
        _backend = previous


def _use_triton(tensor: torch.Tensor) -> bool:
    backend = get_backend()
    return backend == "triton" or (backend == "auto" and tensor.is_cuda)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, KVH, D] into the caches at `slot_mapping` [T] (slot -1 = skip)."""
    impl = store_kv_triton if _use_triton(key) else store_kv_ref
    impl(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, *, window: int | None = None, sinks: torch.Tensor | None = None,
                    softcap: float | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Causal attention of a mixed batch over the paged cache. q: [T, H, D] -> [T, H, D].

    A layer's features: `window` (a row at position p sees the last `window` positions, p included; None =
    all), `sinks` ([H] logits, one value-less key per head in the softmax's denominator, gpt-oss),
    `softcap` (scores c * tanh(score / c), Gemma 2).
    `num_splits` (Triton only): None = automatic split-K choice, 1 = never split, n = n splits.
    """
    if _use_triton(q):
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, window=window, sinks=sinks, softcap=softcap,
                                      num_splits=num_splits)
    return paged_attention_cpu(q, k_cache, v_cache, meta, scale, window=window, sinks=sinks, softcap=softcap)


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks `block_mapping[:, 0]` to `block_mapping[:, 1]` in every layer, K and V."""
    impl = copy_blocks_triton if _use_triton(kv_cache) else copy_blocks_ref
    impl(kv_cache, block_mapping)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [T, hidden]; with `residual`, normalizes x + residual and returns (y, x + residual)."""
    impl = rms_norm_triton if _use_triton(x) else rms_norm_ref
    return impl(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I]."""
    return silu_and_mul_triton(x) if _use_triton(x) else silu_and_mul_ref(x)
