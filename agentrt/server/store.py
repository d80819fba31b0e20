"""Persistence of programs and their LLM calls: SQLite by default, PostgreSQL by URL.

Writes never block the caller: `put_program` / `put_call` snapshot the record into a bounded
in-memory queue, and one writer thread drains it in batches, one transaction per batch, upserting
by primary key (the last put of an id within a batch wins). When the queue is full the oldest
entry is dropped and counted (`num_dropped`); a failed write is logged and counted
(`num_write_errors`) and never stops the writer. Reads (`store_reads.StoreReads`, a base of `Store`)
are plain blocking calls (the server runs them in a worker thread) and see every write that `flush` has
waited for.

Times are unix epoch seconds (`time.time()`), so rows stay meaningful across restarts; durations
are seconds.
"""

from __future__ import annotations

import collections
import logging
import operator
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import fields
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, InterfaceError, NoSuchModuleError, OperationalError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from agentrt.server.records import (  # noqa: F401  (the store's API types, re-exported)
    ANY_OWNER,
    CallRecord,
    ProgramRecord,
    ResponseRecord,
    _AnyOwner,
    _Base,
    _Call,
    _Program,
    _Response,
)
from agentrt.server.store_reads import StoreReads

logger = logging.getLogger(__name__)


_PROGRAM_FIELDS = tuple(f.name for f in fields(ProgramRecord))
_RESPONSE_FIELDS = tuple(f.name for f in fields(ResponseRecord))
_snapshot_response = operator.attrgetter(*_RESPONSE_FIELDS)
_CALL_FIELDS = tuple(f.name for f in fields(CallRecord))
_snapshot_program = operator.attrgetter(*_PROGRAM_FIELDS)  # -> tuple of values, in field order
_snapshot_call = operator.attrgetter(*_CALL_FIELDS)
_PROGRAM, _CALL, _RESPONSE = 0, 1, 2  # queue entry kinds
_TABLES = ((_Program, _PROGRAM_FIELDS), (_Call, _CALL_FIELDS), (_Response, _RESPONSE_FIELDS))  # by kind
_WARN_DROPS_EVERY_S = 10.0


def default_url(served_model: str | None = None) -> str:
    """`$AGENTRT_DB` (a file path, or a URL), else a SQLite file in the cache directory: `agentrt.db`, or
    with `served_model` the server's own, `records/<served model>.db`.

    A server owns its database: at start-up it closes the programs its previous run left running, so two
    servers must not share one. The default file per served model keeps a fresh server of another model
    from listing (and closing) someone else's programs; two servers of the same model need a `--db` each."""
    db = os.environ.get("AGENTRT_DB")
    if db and "://" in db:
        return db
    if not db:
        from agentrt.engine.loader import cache_dir

        name = "agentrt" if served_model is None else f"records/{_file_name(served_model)}"
        db = str(cache_dir() / f"{name}.db")
    return f"sqlite:///{Path(db).expanduser()}"


def _file_name(text: str) -> str:
    """`text` as one file name: path separators and other odd characters become '_'."""
    return re.sub(r"[^\w.-]", "_", text).lstrip(".") or "_"


def _make_engine(url: str) -> tuple[Engine, bool]:
    """The engine, and whether it is one in-memory SQLite connection shared by all threads."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    if u.get_backend_name() != "sqlite":
        return create_engine(u, pool_pre_ping=True), False  # a server runs for weeks: connections go stale
    if u.database in (None, "", ":memory:"):
        # one connection for every thread, or each would see its own empty database
        return create_engine(u, poolclass=StaticPool, connect_args={"check_same_thread": False}), True
    if not u.database.startswith("file:"):
        Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(u, connect_args={"timeout": 30.0})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")  # readers do not wait for the writer
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    return engine, False


def check_url(url: str) -> None:
    """Connect once to the database at `url` (a SQLite file's directory made, as `Store` makes it): ValueError
    saying why records cannot be kept there (a malformed URL, a dialect or driver not installed, a directory
    that cannot be made, a database that refuses the connection). Blocking."""
    try:
        engine, _ = _make_engine(url)
    except NoSuchModuleError:  # an ArgumentError: first
        raise ValueError(f"SQLAlchemy has no dialect {make_url(url).drivername!r} (sqlite, postgresql, "
                         "mysql, ...)") from None
    except ArgumentError:
        raise ValueError("not a SQLAlchemy URL (a SQLite file is sqlite:///relative/path.db or "
                         "sqlite:////absolute/path.db)") from None
    except ImportError as e:
        raise ValueError(f"its database driver is not installed (no module {e.name or str(e)!r})") from None
    except OSError as e:
        why = "a file is in the way" if isinstance(e, FileExistsError) else e.strerror or str(e)
        raise ValueError(f"cannot make the database's directory {e.filename!r}: {why}") from None
    try:
        with engine.connect():
            pass
    except SQLAlchemyError as e:
        reason = str(getattr(e, "orig", None) or e).strip().splitlines()
        raise ValueError(f"cannot connect: {reason[0] if reason else type(e).__name__}") from None
    finally:
        engine.dispose()


def _add_missing_columns(conn: Connection) -> None:
    """Columns a newer agentrt added to a table (nullable ones) that a database made by an older one lacks."""
    names = inspect(conn)
    for table in _Base.metadata.sorted_tables:
        have = {c["name"] for c in names.get_columns(table.name)}
        for col in table.columns:
            if col.name not in have and col.nullable:
                kind = col.type.compile(dialect=conn.dialect)
                conn.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{col.name}" {kind}'))
                logger.info("store: added the column %s.%s", table.name, col.name)


class Store(StoreReads):
    """Programs and calls in a SQL database, written off the caller's thread.

    `Store(url)`: None for the default SQLite file (`default_url`), or any SQLAlchemy URL
    (`sqlite:///path`, `sqlite://` in memory, `postgresql://...`, which uses psycopg 3).
    Call `start()` before use and `close()` at the end (or use it as a context manager).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        max_queue: int = 100_000,
        batch_size: int = 500,
        batch_interval_s: float = 0.05,
    ) -> None:
        if max_queue < 1 or batch_size < 1 or batch_interval_s < 0:
            raise ValueError(
                f"need max_queue >= 1, batch_size >= 1, batch_interval_s >= 0; got {max_queue}, "
                f"{batch_size}, {batch_interval_s}"
            )
        self.url = url if url is not None else default_url()
        self.num_write_errors = 0  # records lost to a failed write
        self.num_dropped = 0  # records dropped unwritten because the queue was full
        self._engine, shared_conn = _make_engine(self.url)
        # a shared connection must not interleave transactions (a reader's rollback-on-return
        # would undo the writer's work), so every use of it is serialized
        self._conn_lock = threading.Lock() if shared_conn else nullcontext()
        self._max_queue = max_queue
        self._batch_size = batch_size
        self._batch_interval_s = batch_interval_s
        # entries: (seq, kind, values); seq numbers every put, so flush knows what came before it
        self._queue: collections.deque[tuple[int, int, tuple]] = collections.deque()
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)  # the writer waits on it
        self._progress = threading.Condition(self._lock)  # flush waits on it
        self._seq = 0
        self._inflight_first: int | None = None  # seq of the oldest entry being written
        self._flush_waiters = 0
        self._stopping = False
        self._last_drop_warning = float("-inf")
        self._thread: threading.Thread | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"Store({make_url(self.url).render_as_string(hide_password=True)!r})"

    def __enter__(self) -> Store:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Create the tables if missing and start the writer thread. Idempotent."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._thread is not None:
            return
        with self._connect(write=True) as conn:
            _Base.metadata.create_all(conn)
            _add_missing_columns(conn)
        self._thread = threading.Thread(target=self._run, name="agentrt-store-writer", daemon=True)
        self._thread.start()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Block until everything put before this call is written (or failed, or dropped).
        False on timeout."""
        with self._lock:
            target = self._seq
            self._flush_waiters += 1
            self._has_work.notify()  # cut the writer's batching wait short
            try:
                return self._progress.wait_for(lambda: not self._pending_through(target), timeout_s)
            finally:
                self._flush_waiters -= 1

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush, stop the writer and release the database. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None and not self.flush(timeout_s):
            logger.warning("%r: closing with %d records unwritten", self, len(self._queue))
        with self._lock:
            self._stopping = True  # later puts are ignored
            self._queue.clear()
            self._has_work.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._engine.dispose()

    # -- writes -----------------------------------------------------------------------------

    def put_program(self, rec: ProgramRecord) -> None:
        """Insert or replace the program `rec.program_id`. Non-blocking."""
        if not isinstance(rec, ProgramRecord):
            raise TypeError(f"put_program takes a ProgramRecord, got {type(rec).__name__}")
        self._put(_PROGRAM, _snapshot_program(rec))

    def put_call(self, rec: CallRecord) -> None:
        """Insert or replace the call `rec.request_id`. Non-blocking."""
        if not isinstance(rec, CallRecord):
            raise TypeError(f"put_call takes a CallRecord, got {type(rec).__name__}")
        self._put(_CALL, _snapshot_call(rec))

    def put_response(self, rec: ResponseRecord) -> None:
        """Insert or replace the response `rec.response_id`. Non-blocking."""
        if not isinstance(rec, ResponseRecord):
            raise TypeError(f"put_response takes a ResponseRecord, got {type(rec).__name__}")
        self._put(_RESPONSE, _snapshot_response(rec))

    def _put(self, kind: int, values: tuple) -> None:
        with self._lock:
            if self._stopping:
                return
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self.num_dropped += 1
                now = time.monotonic()
                if now - self._last_drop_warning >= _WARN_DROPS_EVERY_S:
                    self._last_drop_warning = now
                    logger.warning(
                        "%r: write queue full (%d), dropping the oldest records (%d so far)",
                        self, self._max_queue, self.num_dropped,
                    )
                self._progress.notify_all()
            self._seq += 1
            self._queue.append((self._seq, kind, values))
            if len(self._queue) == 1 or len(self._queue) == self._batch_size:
                self._has_work.notify()

    def _pending_through(self, seq: int) -> bool:
        """Whether some entry numbered <= seq is still queued or being written (lock held)."""
        if self._inflight_first is not None:
            return self._inflight_first <= seq
        return bool(self._queue) and self._queue[0][0] <= seq

    def _run(self) -> None:
        while True:
            with self._lock:
                self._has_work.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                if len(self._queue) < self._batch_size and not self._flush_waiters:
                    self._has_work.wait_for(
                        lambda: len(self._queue) >= self._batch_size or self._flush_waiters or self._stopping,
                        self._batch_interval_s,
                    )
                    if self._stopping:
                        return
                batch = [self._queue.popleft() for _ in range(min(self._batch_size, len(self._queue)))]
                self._inflight_first = batch[0][0]
            try:
                self._write_batch(batch)
            except Exception:  # the writer must outlive any bug or database failure
                logger.exception("%r: writer failed on a batch of %d records", self, len(batch))
                self.num_write_errors += len(batch)
            finally:
                with self._lock:
                    self._inflight_first = None
                    self._progress.notify_all()

    def _write_batch(self, batch: list[tuple[int, int, tuple]]) -> None:
        rows: list[dict[str, tuple]] = [{}, {}, {}]  # by kind
        for _, kind, values in batch:
            rows[kind][values[0]] = values  # coalesce by primary key
        total = sum(len(r) for r in rows)
        try:
            self._upsert([list(r.values()) for r in rows])
            return
        except (OperationalError, InterfaceError):  # the database is unreachable: no use retrying row by row
            logger.exception("%r: lost a batch of %d records", self, total)
            self.num_write_errors += total
            return
        except Exception:
            logger.warning("%r: batch write failed; retrying its records one by one", self, exc_info=True)
        for kind, by_key in enumerate(rows):
            for key, values in by_key.items():
                try:
                    self._upsert([[values] if k == kind else [] for k in range(3)])
                except Exception:
                    logger.exception("%r: could not write %s %r", self, _TABLES[kind][0].__tablename__, key)
                    self.num_write_errors += 1

    def _upsert(self, rows_by_kind: list[list[tuple]]) -> None:
        with self._connect(write=True) as conn:  # one transaction
            for (model, names), rows in zip(_TABLES, rows_by_kind):
                if rows:
                    conn.execute(self._upsert_stmt(model), [dict(zip(names, r)) for r in rows])

    def _upsert_stmt(self, model: type[_Base]) -> Any:
        table = model.__table__
        dialect = self._engine.dialect.name
        insert = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}.get(dialect)
        if insert is None:
            raise NotImplementedError(f"{self!r}: upsert is written for SQLite and PostgreSQL, not {dialect}")
        stmt = insert(table)
        pk = [c.name for c in table.primary_key]
        return stmt.on_conflict_do_update(
            index_elements=pk, set_={c.name: stmt.excluded[c.name] for c in table.columns if not c.primary_key}
        )

    @contextmanager
    def _connect(self, write: bool = False) -> Iterator[Connection]:
        with self._conn_lock, (self._engine.begin() if write else self._engine.connect()) as conn:
            yield conn
