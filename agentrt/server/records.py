"""What the store keeps: the record types its API takes and returns, and their SQLAlchemy tables
(private to `store.py`). Times are unix epoch seconds; durations are seconds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sqlalchemy import JSON, Double, Index, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class _AnyOwner:
    def __repr__(self) -> str:
        return "ANY_OWNER"


ANY_OWNER: Final = _AnyOwner()
"""`owner=` default of the reads: do not filter by owner (`owner=None` means "no owner")."""


@dataclass(slots=True)
class ProgramRecord:
    """One program, as stored."""

    program_id: str
    owner: str | None  # fingerprint of the API key that started it, never the key
    name: str
    parent_id: str | None  # the program that called this one
    state: str  # "running" / "finished" / "failed" / "cancelled" / "ended"
    policy: str  # scheduling policy it ran under
    created_at: float  # epoch s
    ended_at: float | None = None  # epoch s
    calls_done: int = 0
    service_s: float = 0.0  # Σ executor time of its calls
    wait_s: float = 0.0  # Σ queueing time of its calls
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class CallRecord:
    """One LLM call (an engine request), as stored."""

    request_id: str
    program_id: str
    thread_id: str | None  # the program's parallel branch that made it
    kind: str  # "chat" / "completion" / "responses"
    arrival_at: float  # epoch s
    first_token_s: float | None = None  # time to first token, from arrival
    finished_at: float | None = None  # epoch s
    latency_s: float | None = None  # arrival -> last token
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    policy: str = ""
    service_s: float = 0.0  # executor time attributed to this call
    queued_s: float | None = None  # arrival -> first scheduled; None: never scheduled
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_tier_loaded_tokens: int = 0  # of those, loaded from a KV tier below the pool
    preemptions: list | None = None  # [[preempted, scheduled again or null], ...], seconds from arrival
    pin_ttl_s: float | None = None  # TTL its program's KV was pinned for at its end
    tool: str | None = None  # the tool its program ran between its previous call and this one, if told
    priority: int = 0  # scheduling class
    replica: str | None = None  # the replica that served it (serve --replicas)


@dataclass(slots=True)
class ResponseRecord:
    """One stored Responses-API response (`store: true`), for `previous_response_id`."""

    response_id: str
    owner: str | None
    program_id: str  # a chain of responses is one program
    created_at: float  # epoch s
    body: str  # the response object, JSON
    messages: str  # the conversation through this response (input + output) as chat messages, JSON


class _Base(DeclarativeBase):
    type_annotation_map = {float: Double()}


class _Program(_Base):
    __tablename__ = "programs"
    __table_args__ = (Index("ix_programs_owner_created", "owner", "created_at"),)

    program_id: Mapped[str] = mapped_column(String, primary_key=True)
    owner: Mapped[str | None]
    name: Mapped[str]
    parent_id: Mapped[str | None]
    state: Mapped[str]
    policy: Mapped[str]
    created_at: Mapped[float] = mapped_column(index=True)
    ended_at: Mapped[float | None]
    calls_done: Mapped[int]
    service_s: Mapped[float]
    wait_s: Mapped[float]
    num_prompt_tokens: Mapped[int]
    num_output_tokens: Mapped[int]
    error: Mapped[str | None] = mapped_column(Text)


class _Call(_Base):
    __tablename__ = "calls"

    request_id: Mapped[str] = mapped_column(String, primary_key=True)
    program_id: Mapped[str] = mapped_column(index=True)
    thread_id: Mapped[str | None]
    kind: Mapped[str]
    arrival_at: Mapped[float]
    first_token_s: Mapped[float | None]
    finished_at: Mapped[float | None]
    latency_s: Mapped[float | None]
    num_prompt_tokens: Mapped[int]
    num_output_tokens: Mapped[int]
    finish_reason: Mapped[str | None]
    error: Mapped[str | None] = mapped_column(Text)
    policy: Mapped[str]
    service_s: Mapped[float]
    # added with program timelines (issue 52): nullable, so a database of an older server gains them in place
    # (store.Store.start adds missing columns)
    queued_s: Mapped[float | None]
    num_cached_tokens: Mapped[int | None]
    num_tier_loaded_tokens: Mapped[int | None]
    preemptions: Mapped[list | None] = mapped_column(JSON)
    pin_ttl_s: Mapped[float | None]
    tool: Mapped[str | None]
    priority: Mapped[int | None]
    replica: Mapped[str | None]


class _Response(_Base):
    __tablename__ = "responses"

    response_id: Mapped[str] = mapped_column(String, primary_key=True)
    owner: Mapped[str | None]
    program_id: Mapped[str] = mapped_column(index=True)
    created_at: Mapped[float]
    body: Mapped[str] = mapped_column(Text)
    messages: Mapped[str] = mapped_column(Text)
