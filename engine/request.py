"""A request: one LLM call as the engine sees it.

No prefill/decode phase: the scheduler grants `min(num_tokens - num_computed_tokens, budget)`
tokens per step, so chunked prefill, prefix hits and decode are one case.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrt.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks (new or preempted)
    RUNNING = "running"  # holds blocks, scheduled each step while budget allows
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or model context reached
    FINISHED_ABORTED = "abort"  # aborted by the client
    FINISHED_ERROR = "error"  # can never run (e.g. does not fit the KV cache)

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    program_id: str | None = None  # owning program (agentrt); None = a call of its own
    thread_id: str | None = None  # parallel branch within the program
    cache_salt: str | None = None  # tenant key mixed into the first block's hash
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: frozenset[int] = frozenset()  # from the model; ignored with sampling.ignore_eos
    max_model_len: int = 1 << 30  # context limit: finish with "length" when reached
    lora: Any = None  # engine.lora.LoRAAdapter the request runs with; None = the base model

    all_token_ids: list[int] = field(init=False)  # prompt + output
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)  # per output token, when sampling.wants_logprobs
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per output token:
    # the sampling.top_logprobs most likely (token id, log-prob), best first, when top_logprobs > 0
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)  # block table, one id per block_size tokens (layer group 0)
    extra_tables: list[list[int]] = field(default_factory=list)  # the block tables of layer groups 1.. (engine.kv_layout;
    # empty for a model of one group); a window group's entries for blocks that left its window are NULL_BLOCK (-1)
    blocks_version: int = 0  # bumped on every change to a block table other than appending (a runner keeping
    # tables across steps rewrites the request's rows then)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks (prefix cache)
    num_cached_blocks: int = 0  # leading blocks already registered in the hash index
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None  # why it failed, for FINISHED_ERROR (bad input, or an engine error while serving it)
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_recomputed_tokens: int = 0  # tokens computed again after a preemption
    num_tier_loaded_tokens: int = 0  # prompt tokens the KV tiers loaded for it before its first admission
    preemptions: list[list[float | None]] = field(default_factory=list)  # [preempted at, rescheduled at or None]
    # per preemption (EngineCore notes them around the schedule)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    service_s: float = 0.0  # model-executor time attributed to this request
    generator: torch.Generator | None = None  # per-request RNG when sampling.seed is set
    parent: Request | None = None  # for n > 1: the request this one was forked from
    fork_index: int = 0  # which of the parent's n completions
    children: list[Request] = field(default_factory=list)  # n > 1: forked off after the first sample
    policy_state: dict[str, Any] = field(default_factory=dict)  # scratch owned by the scheduling policy
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens for this step (spec_decode)
    matcher: Any = None  # grammar matcher of a constrained request (engine.structured), its own per fork
    waiting_matcher: Any = None  # the matcher while its grammar waits for the constraint's `after` tokens
    history: Any = None  # engine.sampling.TokenHistory of all_token_ids, for penalties (made on first use)
    prompt_logprobs: list[float | None] = field(default_factory=list)  # per prompt token (the first's is
    # None), when sampling.prompt_logprobs is set; filled as prefill chunks are computed
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)  # per prompt
    # position, the sampling.prompt_logprobs most likely (token id, log-prob) (None for the first)
    prompt_ranks: list[int | None] = field(default_factory=list)  # per prompt token, 1 + how many tokens
    # the model found more likely at its position (None for the first)
    pooled: Any = None  # a pooling request's fp32 sum of the rows its pooling read so far [hidden]
    embedding: list[float] | None = None  # a pooling request's vector, once its prompt is computed

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling.seed + self.fork_index)  # < 2**64

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def tables(self) -> list[list[int]]:
        """Its block tables, one per layer group (group 0 first)."""
        return [self.block_ids, *self.extra_tables]

    def held_blocks(self) -> list[int]:
        """Every block its tables hold, deepest position first across groups (the order they are freed in)."""
        if not self.extra_tables:
            return [b for b in reversed(self.block_ids) if b >= 0]
        tables = self.tables
        width = max(map(len, tables))
        return [t[i] for i in range(width - 1, -1, -1) for t in tables if i < len(t) and t[i] >= 0]

    @property
    def constrained(self) -> bool:
        """Whether a grammar holds or will hold its output (no drafts, no multi-step decode)."""
        return self.matcher is not None or self.waiting_matcher is not None

    @property
    def cache_key(self) -> str:
        """What prefix-cache hashes mix in besides the tokens: the tenant salt and the LoRA adapter (the
        salt's length first, so no salt can spell another salt and adapter)."""
        salt = self.cache_salt or ""
        return f"{len(salt)}:{salt}|{self.lora.hash_key if self.lora is not None else ''}"

    def append_token(
        self, token_id: int, logprob: float | None = None, top: list[tuple[int, float]] | None = None
    ) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, program={self.program_id!r})"
        )
