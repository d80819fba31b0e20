"""The store's reads and its in-place updates (`StoreReads`, a base of `store.Store`): blocking calls, run by
the server in a worker thread, that see every write `flush` has waited for.

Lists page by cursor, as OpenAI's do: a page holds `limit` rows after the row named by the cursor, and
the caller asks for `limit + 1` to learn whether more exist.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import MISSING, fields
from typing import Any

from sqlalchemy import Connection, Select, and_, delete, func, or_, select, update

from agentrt.server.records import (
    ANY_OWNER,
    CallRecord,
    ProgramRecord,
    ResponseRecord,
    _AnyOwner,
    _Call,
    _Program,
    _Response,
)

_PRUNE_CHUNK = 1000  # programs deleted per transaction
INTERRUPTED = "interrupted"  # the state of a program whose server stopped (killed, crashed) while it ran
INTERRUPTED_ERROR = "the server stopped while this program ran"

# a call's fields with a non-None default: the columns added after the first release are nullable (an older
# server's database gains them in place, its rows holding NULL there), read back as the record's default
_CALL_DEFAULTS = {f.name: f.default for f in fields(CallRecord) if f.default is not MISSING and f.default is not None}


def _call_record(row: Any) -> CallRecord:
    values = dict(row._mapping)
    for name, default in _CALL_DEFAULTS.items():
        if values[name] is None:
            values[name] = default
    return CallRecord(**values)


def _where_program(q: Select, owner: str | None | _AnyOwner, state: str | None) -> Select:
    if owner is not ANY_OWNER:
        q = q.where(_Program.owner.is_(None) if owner is None else _Program.owner == owner)
    if state is not None:
        q = q.where(_Program.state == state)
    return q


def _where_owner(q: Any, table: type[_Program] | type[_Response], owner: str | None | _AnyOwner) -> Any:
    if isinstance(owner, _AnyOwner):
        return q
    return q.where(table.owner.is_(None) if owner is None else table.owner == owner)


class StoreReads:
    """Queries over the tables `store.Store` writes; it supplies `_connect` and `flush`."""

    def _connect(self, write: bool = False) -> AbstractContextManager[Connection]:
        raise NotImplementedError

    def flush(self, timeout_s: float = 10.0) -> bool:
        raise NotImplementedError

    def get_program(self, program_id: str, owner: str | None | _AnyOwner = ANY_OWNER) -> ProgramRecord | None:
        """The program, or None if unknown or (with `owner=`) owned by someone else."""
        q = _where_program(select(*_Program.__table__.columns), owner, None)
        with self._connect() as conn:
            row = conn.execute(q.where(_Program.program_id == program_id)).first()
        return None if row is None else ProgramRecord(**row._mapping)

    def list_programs(
        self,
        owner: str | None | _AnyOwner = ANY_OWNER,
        state: str | None = None,
        limit: int = 100,
        offset: int = 0,
        before: tuple[float, str] | None = None,
    ) -> list[ProgramRecord]:
        """Programs, newest (by `created_at`, then id) first; with `before=(created_at, program_id)`, only
        those after that one in this order (the page after it)."""
        q = _where_program(select(*_Program.__table__.columns), owner, state)
        if before is not None:
            at, pid = before
            q = q.where(or_(_Program.created_at < at, and_(_Program.created_at == at, _Program.program_id < pid)))
        q = q.order_by(_Program.created_at.desc(), _Program.program_id.desc()).limit(limit).offset(offset)
        with self._connect() as conn:
            return [ProgramRecord(**row._mapping) for row in conn.execute(q)]

    def count_programs(self, owner: str | None | _AnyOwner = ANY_OWNER, state: str | None = None) -> int:
        q = _where_program(select(func.count()).select_from(_Program), owner, state)
        with self._connect() as conn:
            return conn.execute(q).scalar_one()

    def get_response(self, response_id: str, owner: str | None | _AnyOwner = ANY_OWNER) -> ResponseRecord | None:
        q = _where_owner(select(*_Response.__table__.columns).where(_Response.response_id == response_id),
                         _Response, owner)
        with self._connect() as conn:
            row = conn.execute(q).first()
        return None if row is None else ResponseRecord(**row._mapping)

    def delete_response(self, response_id: str, owner: str | None | _AnyOwner = ANY_OWNER) -> bool:
        """Delete a stored response (only `owner`'s, when given), after every write put before this
        call has landed, so a response still queued is deleted too. Whether one was deleted."""
        self.flush()
        q = _where_owner(delete(_Response).where(_Response.response_id == response_id), _Response, owner)
        with self._connect(write=True) as conn:
            return conn.execute(q).rowcount > 0

    def list_calls(self, program_id: str, limit: int = 1000, after: str | None = None) -> list[CallRecord]:
        """A program's calls in arrival order; with `after` (a request id of the program's calls), those
        that follow it. LookupError when `after` is not one of its calls."""
        q = select(*_Call.__table__.columns).where(_Call.program_id == program_id)
        with self._connect() as conn:
            if after is not None:
                at = conn.execute(select(_Call.arrival_at).where(
                    _Call.request_id == after, _Call.program_id == program_id)).scalar()
                if at is None:
                    raise LookupError(after)
                q = q.where(or_(_Call.arrival_at > at, and_(_Call.arrival_at == at, _Call.request_id > after)))
            q = q.order_by(_Call.arrival_at, _Call.request_id).limit(limit)
            return [_call_record(row) for row in conn.execute(q)]

    def interrupt_running(self, now: float, program_id: str | None = None) -> int:
        """Close the programs recorded as running (or only `program_id`) as `interrupted`, ended at `now`,
        with the totals of their recorded calls (a running program's row is written only at its start), and
        their calls recorded without an end likewise; how many programs. A server runs it at start-up on the
        records its previous run left: a database holds one server's records."""
        self.flush()
        progs = update(_Program).where(_Program.state == "running")
        calls = update(_Call).where(_Call.finished_at.is_(None))
        if program_id is not None:
            progs = progs.where(_Program.program_id == program_id)
            calls = calls.where(_Call.program_id == program_id)
        ended = select().select_from(_Call).where(_Call.program_id == _Program.program_id,
                                                  _Call.finished_at.is_not(None))
        totals = {"calls_done": ended.add_columns(func.count()).scalar_subquery()} | {
            name: ended.add_columns(func.coalesce(func.sum(getattr(_Call, name)), 0)).scalar_subquery()
            for name in ("num_prompt_tokens", "num_output_tokens", "service_s")}
        with self._connect(write=True) as conn:
            n = conn.execute(progs.values(state=INTERRUPTED, ended_at=now, error=INTERRUPTED_ERROR, **totals)).rowcount
            conn.execute(calls.values(finished_at=now, finish_reason=INTERRUPTED, error=INTERRUPTED_ERROR))
            return n

    def prune(self, max_programs: int) -> int:
        """Keep the `max_programs` newest ended programs (by `created_at`); delete older ended
        programs and their calls. Running programs are never deleted. Returns how many went."""
        if max_programs < 0:
            raise ValueError(f"max_programs must be >= 0, got {max_programs}")
        doomed = (
            select(_Program.program_id)
            .where(_Program.state != "running")
            .order_by(_Program.created_at.desc(), _Program.program_id.desc())
            .offset(max_programs)
            .limit(_PRUNE_CHUNK)
        )
        num_deleted = 0
        while True:
            with self._connect(write=True) as conn:  # small transactions: the writer keeps going meanwhile
                ids = list(conn.execute(doomed).scalars())
                if not ids:
                    return num_deleted
                conn.execute(delete(_Call).where(_Call.program_id.in_(ids)))
                conn.execute(delete(_Response).where(_Response.program_id.in_(ids)))
                conn.execute(delete(_Program).where(_Program.program_id.in_(ids)))
            num_deleted += len(ids)

