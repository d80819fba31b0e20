"""GPU tests: the Triton kernels compiled for a CUDA device, and the engine on it.

Skipped without CUDA, and under TRITON_INTERPRET=1 (the CPU suite's setting): run them on a GPU
machine as `TRITON_INTERPRET=0 pytest tests/gpu` (scripts/gpu_check.sh does).
"""

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return
    reason = "needs a CUDA GPU" if not torch.cuda.is_available() else "TRITON_INTERPRET=1 (run with TRITON_INTERPRET=0)"
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=reason))
