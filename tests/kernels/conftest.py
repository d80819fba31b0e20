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
