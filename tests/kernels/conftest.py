"""Kernel tests run the Triton kernels on CPU through the Triton interpreter.

TRITON_INTERPRET=1 must be in the environment when the kernels run (the launchers wrap kernels
decorated earlier); setting it here, before this directory's tests import triton, covers a
session that only runs tests/kernels.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest

from tests.paged_batch import PagedBatch, make_paged_batch  # noqa: F401


@pytest.fixture
def paged_batch():
    """Factory: `paged_batch(q_lens, seq_lens, H, KVH, D, block_size, dtype)` -> PagedBatch."""
    return make_paged_batch


@pytest.fixture(params=["avx512_bf16", "avx512", "avx2"])
def cpu_kind(request):
    """Each x86 CPU kind of the C++ kernels this machine supports, forced in turn (the others skip)."""
    from agentrt.kernels import cpu

    if request.param not in cpu.supported_kinds():
        pytest.skip(f"this CPU does not support the {request.param} kernels")
    if not cpu.available(request.param):
        pytest.skip("C++ CPU kernels cannot be built here")
    with cpu.use_kind(request.param):
        yield request.param
