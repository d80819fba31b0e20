"""agentrt's serving engine: paged KV cache, continuous batching, pluggable scheduling.

Importable with torch, triton and transformers alone (no agentrt imports)."""


def _check_kernels_package() -> None:
    """The kernels floor is the top-level package `kernels`, and so is Hugging Face's `kernels` (which
    transformers >= 5.25 requires, and which any transformers imports when it is installed): with both
    in one environment one hides the other. Ours hidden, nothing here works: an ImportError saying why.
    Theirs hidden, the engine works but transformers' model classes fail to import (HF comparisons,
    GGUF conversion): a warning saying why."""
    import importlib.metadata
    import importlib.util
    import warnings
    from pathlib import Path

    ours = Path(__file__).resolve().parent.parent / "kernels" / "__init__.py"
    spec = importlib.util.find_spec("kernels")
    try:
        importlib.metadata.distribution("kernels")
        hf = True
    except importlib.metadata.PackageNotFoundError:
        hf = False
    fix = ("Remove it with `pip uninstall kernels` and keep transformers below 5.25 "
           "(`pip install 'transformers<5.25'`, as pyproject.toml pins it)")
    if spec is None or spec.origin is None or Path(spec.origin).resolve() != ours:
        found = "nothing" if spec is None else (spec.origin or "a namespace package")
        raise ImportError(f"`import kernels` finds {found}, not agentrt's kernels floor ({ours.parent}): Hugging "
                          f"Face's `kernels` package (transformers >= 5.25 requires it) hides it. {fix}")
    if hf:
        warnings.warn("Hugging Face's `kernels` package is installed, and agentrt's kernels floor hides it: "
                      f"transformers' model classes will fail to import. {fix}", RuntimeWarning, stacklevel=2)


_check_kernels_package()

from engine.async_engine import AsyncEngine, RequestStream
from engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.config import EngineConfig
from engine.engine_core import EngineCore, KVStats
from engine.llm import LLM
from engine.lora import LoRARequest
from engine.outputs import CompletionOutput, RequestOutput, StreamDelta
from engine.policy import FCFS, SchedulingPolicy, make_policy, register_policy
from engine.pooling import PoolingParams
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

__all__ = [
    "FCFS",
    "LLM",
    "AsyncEngine",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineConfig",
    "EngineCore",
    "KVStats",
    "LoRARequest",
    "PoolingParams",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "RequestStream",
    "SamplingParams",
    "SchedulingPolicy",
    "StreamDelta",
    "make_policy",
    "register_policy",
]
