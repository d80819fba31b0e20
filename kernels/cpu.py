"""C++ CPU kernels (kernels/csrc/cpu_ops.cpp), compiled on first use and cached.

The engine's fp32 decode on CPU is memory-bound: a one-row projection should cost one read of its
weight, and decode attention one read of each sequence's K and V. Library GEMMs reach about half the
read bandwidth for one row (and, on this AMD CPU, 60-70% of what a register-tiled kernel gets for
decode batches of 16-64 rows), and the torch attention path first gathers a sequence's blocks into
a copy. So:

- `packed_linear(x, w_packed, bias, N)`: `x @ w.T + bias` in fp32 from the panel-packed weight
  (kernels/linear.py);
- `paged_attention_small_q(...)`: attention of sequences with 1-16 query rows read straight from
  the paged cache through the block tables;
- `rms_norm(x, w, eps)` and `silu_and_mul(x)`: one pass each (the model calls them on CPU fp32).

Built with torch's cpp_extension (a C++ compiler and ninja), `-O3 -march=native`, into torch's
extension cache (~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR): the first build takes ~30 s,
later processes load the cached library. When no compiler is there, or AGENTRT_CPU_KERNELS=0, `ops()`
returns None (with one warning) and callers keep their torch paths; `use_cpu_kernels(False)` (a
context manager, process-wide like the kernel backend) turns them off for a block, e.g. to measure or
test the torch paths.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV_VAR = "AGENTRT_CPU_KERNELS"  # "0" disables the C++ kernels
_SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]

_lock = threading.Lock()
_state: dict = {"enabled": True}  # "ops": the loaded namespace or None once tried


def _cpu_tag() -> str:
    """A short tag of this CPU's instruction-set flags: `-march=native` builds are cached per CPU kind,
    so a shared cache directory never hands a library to a CPU that lacks its instructions."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:8]


def _build():
    if os.environ.get(ENV_VAR, "1") == "0":
        return None
    from torch.utils import cpp_extension

    bindir = str(Path(sys.executable).parent)  # ninja installed into a venv that is not activated
    if shutil.which("ninja") is None and bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    try:
        cpp_extension.load(name=f"agentrt_cpu_ops_{_cpu_tag()}", sources=[str(_SOURCE)], extra_cflags=_FLAGS,
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as e:  # no compiler or ninja, or a build error: keep the torch paths
        log.warning("agentrt C++ CPU kernels unavailable (%s: %s); using torch paths", type(e).__name__,
                    str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None
    return torch.ops.agentrt_cpu


def ops():
    """The compiled ops (`torch.ops.agentrt_cpu`), or None when they cannot be built or are disabled."""
    if not _state["enabled"]:
        return None
    if "ops" not in _state:
        with _lock:
            if "ops" not in _state:
                _state["ops"] = _build()
    return _state["ops"]


def available() -> bool:
    return ops() is not None


@contextmanager
def use_cpu_kernels(enabled: bool) -> Iterator[None]:
    """Turn the C++ kernels on or off inside a `with` block (restoring the previous setting after)."""
    previous = _state["enabled"]
    _state["enabled"] = bool(enabled)
    try:
        yield
    finally:
        _state["enabled"] = previous
