"""agentrt's serving engine: paged KV cache, continuous batching, pluggable scheduling.

Importable with torch, triton and transformers alone (no agentrt imports)."""

from engine.async_engine import AsyncEngine, RequestStream
from engine.config import EngineConfig
from engine.engine_core import EngineCore, KVStats
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput, StreamDelta
from engine.policy import FCFS, SchedulingPolicy, make_policy, register_policy
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

__all__ = [
    "FCFS",
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineCore",
    "KVStats",
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
