"""The programs API's contract (`/v1/programs`): msgspec Structs of a program's record and its calls."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from agentrt.server.schemas import Priority, ProgramId


class ProgramCreate(Struct):
    program_id: ProgramId | None = None  # None: the server picks one
    name: Annotated[str, Meta(min_length=1, max_length=128)] = "program"
    priority: Priority = 0  # its calls' scheduling class (smaller first), unless a call names its own


class Program(Struct):
    id: str
    name: str
    state: str  # "running" | "finished" | "failed" | "cancelled" | "interrupted" (its server stopped meanwhile)
    created_at: float  # unix time
    ended_at: float | None
    calls_waiting: int  # submitted, no token yet
    calls_running: int
    calls_done: int
    service_s: float  # attained service: executor time of its completed calls
    critical_path_s: float
    wait_s: float  # queueing time of its completed calls
    num_prompt_tokens: int
    num_output_tokens: int
    queue_level: int | None  # best queue level of its calls in the engine (PLAS / ATLAS / MLFQ)
    kv_blocks: int  # KV blocks its calls in the engine hold
    num_threads: int
    num_prefix_hit_tokens: int = 0  # prompt tokens of its completed calls served from the prefix cache
    kv_blocks_pinned: int = 0  # of its KV blocks, those its pin keeps across a tool call now (0 once expired or ended)
    kv_blocks_reserved: int = 0  # blocks set aside for it (a reservation), used or not
    ttl_s: float = 0.0  # its retention TTL now (0: its KV is not pinned between calls)
    ttl_hits: int = 0  # calls of it admitted while its pin still held its prefix
    ttl_misses: int = 0  # calls of it admitted after its pin had expired or given way
    ttl_expiries: int = 0  # its pins dropped at their deadline
    recomputed_prefill_tokens: int = 0  # prompt tokens it had computed in an earlier call, computed again
    kv_tier_loaded_tokens: int = 0  # prompt tokens loaded from the KV tiers below the cache (host, disk), not computed
    error: str | None = None
    live: bool = True  # False: served from the database (a program of an earlier server run)
    priority: int = 0  # its calls' scheduling class
    replicas: list[str] | None = None  # the replicas that ran its calls (`agentrt serve --replicas`); None: one server
    object: str = "program"


class ProgramList(Struct):
    """One page of programs, newest first; the next page: `?after=<last_id>`."""

    data: list[Program]
    object: str = "list"
    has_more: bool = False  # more programs follow this page
    first_id: str | None = None
    last_id: str | None = None


class ProgramCall(Struct):
    """One LLM call of a program, as recorded when it ended."""

    id: str  # its request id
    thread_id: str | None  # the program's parallel branch that made it
    kind: str  # "chat" | "completion" | "responses" | ...
    created_at: float  # unix time of its arrival
    ended_at: float | None
    ttft_s: float | None  # arrival -> first token
    latency_s: float | None  # arrival -> last token
    service_s: float  # executor time attributed to it (what PLAS counts)
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    error: str | None = None


class ProgramCallList(Struct):
    """One page of a program's calls in arrival order; the next page: `?after=<last_id>`."""

    data: list[ProgramCall]  # in arrival order
    object: str = "list"
    has_more: bool = False  # more calls follow this page
    first_id: str | None = None
    last_id: str | None = None
