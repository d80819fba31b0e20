"""Helpers shared by the kernel launchers: launching a `@triton.jit` kernel on the right device."""

from __future__ import annotations

import functools

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

INTERPRETER_HINT = (
    "Triton kernels on CPU tensors run only in the Triton interpreter: set TRITON_INTERPRET=1 "
    "in the environment (before triton is imported, as the tests' conftest does), or use the "
    "'torch' kernel backend"
)


@functools.cache
def _interpreted(fn: object) -> InterpretedFunction:
    return InterpretedFunction(fn)


def launchable(kernel: triton.JITFunction | InterpretedFunction, device: torch.device):
    """The kernel to launch for tensors on `device`.

    On CUDA that is the compiled kernel. On CPU it is the interpreter's version, which needs
    TRITON_INTERPRET=1; kernels decorated before the variable was set are wrapped on first use, so
    the order in which a test session imports modules does not matter.
    """
    if device.type != "cpu":
        return kernel
    if not triton.knobs.runtime.interpret:
        raise RuntimeError(INTERPRETER_HINT)
    if isinstance(kernel, InterpretedFunction):
        return kernel
    return _interpreted(kernel.fn)
