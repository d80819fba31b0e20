"""What the engine shows above it (`AsyncEngine.info`, `stats()`, `request_info`): plain read-only values.

Code above `engine/` reads the engine through these and sends operations through `AsyncEngine`; it never
holds the `EngineCore` (vLLM v1's `EngineClient`). `EngineInfo` is built once, when the engine is; a stats
snapshot and a request's info are built on the event loop between steps, from the core's state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from agentrt.engine.pooling import default_method as default_pooling

if TYPE_CHECKING:
    from agentrt.engine.engine_core import EngineCore, KVStats
    from agentrt.engine.request import Request


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """The served model and the engine's fixed settings."""

    model_name: str  # the model's directory or file name
    model_path: Path  # where it was loaded from
    max_model_len: int  # context length, tokens (prompt + output)
    vocab_size: int
    hidden_size: int
    generation_defaults: Mapping[str, Any]  # the model's sampling defaults (engine.generation_config)
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    has_lm_head: bool  # generates text (a classifier checkpoint may have only its score head)
    has_score_head: bool  # a *ForSequenceClassification checkpoint's head (classify)
    pooling_method: str  # the pooling the checkpoint declares (engine.pooling.default_method)
    lora_enabled: bool
    max_loras: int  # adapters kept loaded at most
    max_lora_rank: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int  # tokens per KV block
    num_blocks: int  # KV blocks in the pool
    dtype: str
    device: str
    tokenizer: Any  # the model's (transformers) tokenizer
    kv_reload_s_per_token: float | None = None  # getting a token's KV back from the KV tiers (start-up probe of the
    # fastest tier); None: no tiers (engine.kv_tiers)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's state between two steps."""

    num_running: int  # requests being decoded (forks count one each)
    num_waiting: int  # requests queued
    kv: KVStats
    calls_per_level: Mapping[int, int]  # requests per queue level (a policy with levels; empty otherwise)
    running_lora_adapters: tuple[str, ...]  # the adapters running requests use, sorted
    waiting_lora_adapters: tuple[str, ...]
    tracked: Mapping[str, int]  # entries of every per-request map (AsyncEngine.num_tracked)
    running_seats: int = 0  # the latest step's running-set limit: max_num_seqs, or the policy's cap (max_running)


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """One unfinished request, as the runtime looks it up."""

    request_id: str
    program_id: str | None
    block_ids: tuple[int, ...]  # the KV blocks it holds
    queue_level: int | None  # its queue under a policy with levels, once ranked; None otherwise
    first_scheduled_time: float | None = None  # when it was first scheduled (monotonic); None while queued
    num_preemptions: int = 0


def engine_info(core: EngineCore) -> EngineInfo:
    c, args, model = core.config, core.model.args, core.model
    return EngineInfo(
        core.model_path.name, core.model_path, core.max_model_len, args.vocab_size, args.hidden_size,
        MappingProxyType(dict(core.generation_defaults)), core.eos_token_ids, core.tokenizer.bos_token_id,
        model.lm_head is not None or args.tie_word_embeddings, model.score is not None,
        default_pooling(core.model_path), core.loras is not None, c.max_loras, c.max_lora_rank, c.max_num_seqs,
        c.max_num_batched_tokens, core.kv.block_size, core.kv.num_blocks, c.dtype, c.device, core.tokenizer,
        core.tiers.reload_s_per_token() if core.tiers is not None else None,
    )


def engine_stats(core: EngineCore, tracked: Mapping[str, int]) -> EngineStats:
    """Between steps (nothing moves the core's state meanwhile)."""
    running, waiting = core.scheduler.running, core.scheduler.waiting
    levels: dict[int, int] = {}
    for req in core.requests.values():
        level = _level(core, req)
        if level is not None:
            levels[level] = levels.get(level, 0) + 1
    return EngineStats(len(running), len(waiting), core.kv_stats(), MappingProxyType(levels),
                       _adapter_names(running), _adapter_names(waiting), MappingProxyType(dict(tracked)),
                       core.scheduler.seats)


def request_info(core: EngineCore, request_id: str) -> RequestInfo | None:
    req = core.requests.get(request_id)
    if req is None:
        return None
    return RequestInfo(request_id, req.program_id, tuple(req.held_blocks()[::-1]), _level(core, req), req.first_scheduled_time,
                       req.num_preemptions)


def _level(core: EngineCore, req: Request) -> int | None:
    level_of = getattr(core.policy, "level", None)
    return level_of(req) if level_of is not None and req.policy_state else None


def _adapter_names(requests: Any) -> tuple[str, ...]:
    return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))
