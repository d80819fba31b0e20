"""agentrt's serving engine: paged KV cache, continuous batching, pluggable scheduling.

Imported as `agentrt.engine`; importable with torch, triton and transformers alone: the `agentrt`
package's own `__init__` loads the runtime lazily, so nothing above this floor is imported."""

from agentrt.engine.async_engine import AsyncEngine, RequestStream
from agentrt.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from agentrt.engine.config import EngineConfig
from agentrt.engine.engine_core import EngineCore, KVStats
from agentrt.engine.llm import LLM
from agentrt.engine.lora import LoRARequest
from agentrt.engine.outputs import CompletionOutput, RequestOutput, StreamDelta
from agentrt.engine.policy import FCFS, SchedulingPolicy, make_policy, register_policy
from agentrt.engine.pooling import PoolingParams
from agentrt.engine.request import Request, RequestStatus
from agentrt.engine.sampling_params import SamplingParams

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
