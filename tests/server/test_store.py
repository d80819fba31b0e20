import dataclasses
import threading
import time

import pytest
from sqlalchemy.exc import OperationalError

from agentrt.server.store import ANY_OWNER, CallRecord, ProgramRecord, Store, default_url

T0 = 1_700_000_000.0


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/agentrt.db"
        return
    from tests.server.pg import create_database, drop_database

    url = create_database(request.getfixturevalue("postgres_url"))
    yield url
    drop_database(url)


@pytest.fixture
def make_store(db_url):
    stores = []

    def make(**kwargs) -> Store:
        stores.append(Store(db_url, **kwargs))
        return stores[-1]

    yield make
    for s in stores:
        s.close()


@pytest.fixture
def store(make_store):
    s = make_store()
    s.start()
    return s


def program(i: int, **kw) -> ProgramRecord:
    fields = dict(program_id=f"p{i}", owner="alice", name=f"prog{i}", parent_id=None, state="running",
                  policy="fcfs", created_at=T0 + i)
    return ProgramRecord(**(fields | kw))


def call(program_id: str, i: int, **kw) -> CallRecord:
    fields = dict(request_id=f"{program_id}-r{i}", program_id=program_id, thread_id=None, kind="chat",
                  arrival_at=T0 + i)
    return CallRecord(**(fields | kw))


def test_program_round_trip_and_upsert(store):
    p = program(1, parent_id="p0")
    store.put_program(p)
    assert store.flush()
    assert store.get_program("p1") == p
    assert store.get_program("nope") is None

    done = program(1, parent_id="p0", state="finished", ended_at=T0 + 9.5, calls_done=3, service_s=1.25,
                   wait_s=0.5, num_prompt_tokens=120, num_output_tokens=45, error=None)
    store.put_program(done)
    assert store.flush()
    assert store.get_program("p1") == done
    assert store.count_programs() == 1


def test_call_round_trip_and_upsert(store):
    c = call("p1", 0, thread_id="t1", kind="responses", policy="plas")
    store.put_call(c)
    assert store.flush()
    assert store.list_calls("p1") == [c]

    done = call("p1", 0, thread_id="t1", kind="responses", policy="plas", first_token_s=0.125,
                finished_at=T0 + 2.0, latency_s=2.0, num_prompt_tokens=17, num_output_tokens=9,
                finish_reason="stop", service_s=0.75)
    store.put_call(done)
    assert store.flush()
    assert store.list_calls("p1") == [done]


def test_repeated_upserts_in_a_batch_are_coalesced(make_store, monkeypatch):
    store = make_store()
    for n in range(50):  # queued before the writer starts, so they form one batch
        store.put_program(program(1, calls_done=n))
        store.put_call(call("p1", 0, num_output_tokens=n))
    store.put_program(program(2))
    written = []
    upsert = store._upsert
    monkeypatch.setattr(store, "_upsert", lambda rows: (written.append((len(rows[0]), len(rows[1]))), upsert(rows)))
    store.start()
    assert store.flush()
    assert written == [(2, 1)]
    assert store.get_program("p1").calls_done == 49
    assert [c.num_output_tokens for c in store.list_calls("p1")] == [49]


def test_calls_listed_in_arrival_order(store):
    for i in (3, 0, 2, 1):
        store.put_call(call("p1", i))
    store.put_call(call("p2", 0))
    assert store.flush()
    assert [c.request_id for c in store.list_calls("p1")] == ["p1-r0", "p1-r1", "p1-r2", "p1-r3"]
    assert [c.request_id for c in store.list_calls("p1", limit=2)] == ["p1-r0", "p1-r1"]
    assert [c.request_id for c in store.list_calls("p2")] == ["p2-r0"]
    assert store.list_calls("p3") == []


def test_list_programs_newest_first_with_filters(store):
    store.put_program(program(0, owner="alice", state="finished"))
    store.put_program(program(1, owner="bob"))
    store.put_program(program(2, owner=None))
    store.put_program(program(3, owner="alice"))
    store.put_program(program(4, owner="alice", state="failed"))
    assert store.flush()

    def ids(programs):
        return [p.program_id for p in programs]

    assert ids(store.list_programs()) == ["p4", "p3", "p2", "p1", "p0"]
    assert ids(store.list_programs(owner=ANY_OWNER, limit=2, offset=1)) == ["p3", "p2"]
    assert ids(store.list_programs(owner="alice")) == ["p4", "p3", "p0"]
    assert ids(store.list_programs(owner=None)) == ["p2"]
    assert ids(store.list_programs(owner="alice", state="running")) == ["p3"]
    assert ids(store.list_programs(state="finished")) == ["p0"]
    assert store.count_programs(owner="alice") == 3

    assert store.get_program("p1", owner="bob").owner == "bob"
    assert store.get_program("p1", owner="alice") is None
    assert store.get_program("p1", owner=None) is None
    assert store.get_program("p2", owner=None).owner is None
    assert store.get_program("p2", owner="alice") is None


def test_prune_deletes_oldest_ended_programs_and_their_calls(store):
    store.put_program(program(0))  # running: kept however old
    for i in range(1, 6):
        store.put_program(program(i, state="finished", ended_at=T0 + i + 1))
        store.put_call(call(f"p{i}", 0))
    store.put_call(call("p0", 0))
    assert store.flush()

    assert store.prune(max_programs=2) == 3
    assert [p.program_id for p in store.list_programs()] == ["p5", "p4", "p0"]
    assert [store.list_calls(f"p{i}") != [] for i in range(6)] == [True, False, False, False, True, True]
    assert store.prune(max_programs=2) == 0
    assert store.prune(max_programs=0) == 2
    assert [p.program_id for p in store.list_programs()] == ["p0"]
    assert store.list_calls("p0") != []


def test_flush_cuts_the_batching_wait_short(make_store):
    store = make_store(batch_interval_s=30.0)
    store.start()
    store.put_program(program(1))
    t = time.monotonic()
    assert store.flush(timeout_s=5.0)
    assert time.monotonic() - t < 5.0
    assert store.get_program("p1") is not None


def test_flush_times_out_when_nothing_writes(make_store):
    store = make_store()
    assert store.flush(timeout_s=0.0)  # nothing queued
    store.put_program(program(1))
    assert not store.flush(timeout_s=0.05)  # not started
    store.start()
    assert store.flush()


def test_puts_do_not_wait_for_the_database(make_store, monkeypatch):
    store = make_store()
    store.start()
    entered, release = threading.Event(), threading.Event()
    upsert = store._upsert
    monkeypatch.setattr(store, "_upsert", lambda rows: (entered.set(), release.wait(10), upsert(rows)))
    store.put_program(program(0))
    assert entered.wait(10), "the writer never reached the database"  # it is now stuck there
    t = time.monotonic()
    for i in range(1, 2001):
        store.put_call(call("p0", i))
    assert time.monotonic() - t < 1.0
    release.set()
    assert store.flush()
    assert len(store.list_calls("p0", limit=5000)) == 2000


def test_survives_a_restart(db_url):
    store = Store(db_url)
    store.start()
    store.put_program(program(1, state="finished", ended_at=T0 + 2))
    store.put_call(call("p1", 0))
    store.close()  # flushes
    store.close()  # idempotent

    again = Store(db_url)
    again.start()  # the tables exist already
    try:
        assert again.get_program("p1") == program(1, state="finished", ended_at=T0 + 2)
        assert again.list_calls("p1") == [call("p1", 0)]
    finally:
        again.close()


def test_writer_survives_a_bad_record(make_store):
    store = make_store()
    store.put_call(call("p1", 0))
    store.put_call(call("p1", 1, kind=None))  # violates NOT NULL: fails the batch
    store.put_call(call("p1", 2))
    store.start()
    assert store.flush()
    assert store.num_write_errors == 1
    assert [c.request_id for c in store.list_calls("p1")] == ["p1-r0", "p1-r2"]  # its batch-mates still written

    store.put_call(call("p1", 3))
    assert store.flush()
    assert [c.request_id for c in store.list_calls("p1")] == ["p1-r0", "p1-r2", "p1-r3"]


def test_writer_survives_a_database_outage(make_store, monkeypatch):
    store = make_store()
    store.start()
    upsert = store._upsert

    def down(rows):
        raise OperationalError("INSERT ...", {}, ConnectionError("server closed the connection"))

    monkeypatch.setattr(store, "_upsert", down)
    store.put_program(program(1))
    store.put_program(program(2))
    assert store.flush()
    assert store.num_write_errors == 2
    assert store.list_programs() == []

    monkeypatch.setattr(store, "_upsert", upsert)
    store.put_program(program(3))
    assert store.flush()
    assert [p.program_id for p in store.list_programs()] == ["p3"]


def test_full_queue_drops_the_oldest(make_store):
    store = make_store(max_queue=3)
    for i in range(5):
        store.put_program(program(i))
    assert store.num_dropped == 2
    store.start()
    assert store.flush()
    assert [p.program_id for p in store.list_programs()] == ["p4", "p3", "p2"]


def test_rejects_other_types(make_store):
    store = make_store()
    with pytest.raises(TypeError, match="ProgramRecord"):
        store.put_program(call("p1", 0))
    with pytest.raises(TypeError, match="CallRecord"):
        store.put_call(program(1))


def test_puts_after_close_are_ignored(make_store):
    store = make_store()
    store.start()
    store.close()
    store.put_program(program(1))
    assert store.flush(timeout_s=0.0)


def test_in_memory_sqlite_is_shared_by_threads():
    with Store("sqlite://") as store:
        store.put_program(program(1))
        store.put_call(call("p1", 0))
        assert store.flush()
        assert store.get_program("p1") == program(1)
        assert store.list_calls("p1") == [call("p1", 0)]


def test_default_url(monkeypatch, tmp_path):
    monkeypatch.delenv("AGENTRT_DB", raising=False)
    monkeypatch.setenv("AGENTRT_CACHE_DIR", str(tmp_path / "cache"))
    assert default_url() == f"sqlite:///{tmp_path}/cache/agentrt.db"
    with Store() as store:
        store.put_program(program(1))
    assert (tmp_path / "cache" / "agentrt.db").is_file()

    monkeypatch.setenv("AGENTRT_DB", str(tmp_path / "other.db"))
    assert default_url() == f"sqlite:///{tmp_path}/other.db"
    monkeypatch.setenv("AGENTRT_DB", "postgresql://u@h/db")
    assert default_url() == "postgresql://u@h/db"


def test_postgresql_url_uses_psycopg():
    store = Store("postgresql://user:secret@localhost:1/db")  # no connection until start()
    assert store._engine.dialect.driver == "psycopg"
    assert "secret" not in repr(store)
    store.close()


def test_response_round_trip_owner_and_prune(make_store):
    from agentrt.server.store import ResponseRecord

    store = make_store()
    store.start()
    store.put_program(program(1, state="finished"))
    store.put_response(ResponseRecord("resp_1", "k1", "p1", 1.0, '{"id": "resp_1"}', "[]"))
    assert store.flush()
    assert store.get_response("resp_1").body == '{"id": "resp_1"}'
    assert store.get_response("resp_1", owner="k1").program_id == "p1"
    assert store.get_response("resp_1", owner="k2") is None
    assert store.get_response("resp_1", owner=None) is None
    assert store.prune(0) == 1
    assert store.get_response("resp_1") is None


def test_delete_response_owner_and_queued_write(make_store):
    from agentrt.server.store import ResponseRecord

    store = make_store()
    store.start()
    store.put_response(ResponseRecord("resp_1", "k1", "p1", 1.0, "{}", "[]"))
    store.put_response(ResponseRecord("resp_2", None, "p1", 1.0, "{}", "[]"))
    assert not store.delete_response("resp_1", owner="k2")  # another key's: kept
    assert store.delete_response("resp_1", owner="k1")  # deleted even if its write was still queued
    assert store.get_response("resp_1") is None and not store.delete_response("resp_1")
    assert not store.delete_response("resp_2", owner="k1")
    assert store.delete_response("resp_2", owner=None)
    assert store.get_response("resp_2") is None


def _old_calls_table(metadata):
    """The calls table as agentrt wrote it before program timelines (commit bef8520, before issue 52's
    columns): what a database made by an older server holds."""
    from sqlalchemy import Column, Double, Integer, String, Table, Text

    return Table(
        "calls", metadata,
        Column("request_id", String, primary_key=True),
        Column("program_id", String, nullable=False, index=True),
        Column("thread_id", String),
        Column("kind", String, nullable=False),
        Column("arrival_at", Double, nullable=False),
        Column("first_token_s", Double),
        Column("finished_at", Double),
        Column("latency_s", Double),
        Column("num_prompt_tokens", Integer, nullable=False),
        Column("num_output_tokens", Integer, nullable=False),
        Column("finish_reason", String),
        Column("error", Text),
        Column("policy", String, nullable=False),
        Column("service_s", Double, nullable=False),
    )


NEW_CALL_COLUMNS = {"queued_s", "num_cached_tokens", "num_tier_loaded_tokens", "preemptions", "pin_ttl_s", "tool",
                    "priority", "replica"}


def test_start_adds_the_new_columns_to_an_older_database(db_url):
    from sqlalchemy import MetaData, create_engine, inspect

    engine = create_engine(db_url.replace("postgresql://", "postgresql+psycopg://", 1))
    old = _old_calls_table(MetaData())
    with engine.begin() as conn:
        old.create(conn)
        conn.execute(old.insert().values(
            request_id="old-r0", program_id="p0", thread_id=None, kind="chat", arrival_at=T0, first_token_s=0.1,
            finished_at=T0 + 1, latency_s=1.0, num_prompt_tokens=7, num_output_tokens=3, finish_reason="stop",
            error=None, policy="plas", service_s=0.5))
    with engine.connect() as conn:
        assert NEW_CALL_COLUMNS.isdisjoint(c["name"] for c in inspect(conn).get_columns("calls"))

    with Store(db_url) as store:  # start() adds what the table lacks, in place
        with engine.connect() as conn:
            columns = {c["name"] for c in inspect(conn).get_columns("calls")}
        assert columns == {f.name for f in dataclasses.fields(CallRecord)}
        (before,) = store.list_calls("p0")
        assert before == CallRecord("old-r0", "p0", None, "chat", T0, 0.1, T0 + 1, 1.0, 7, 3, "stop", None, "plas", 0.5)
        assert (before.queued_s, before.preemptions, before.pin_ttl_s, before.tool, before.replica) == (None,) * 5
        assert (before.num_cached_tokens, before.num_tier_loaded_tokens, before.priority) == (0, 0, 0)  # the defaults
        new = call("p0", 1, queued_s=0.02, num_cached_tokens=16, num_tier_loaded_tokens=4,
                   preemptions=[[0.3, 0.5], [0.9, None]], pin_ttl_s=2.0, tool="search", priority=-1, replica="r1")
        store.put_call(new)
        assert store.flush()
        assert store.list_calls("p0") == [before, new]
    with Store(db_url) as again:  # a second start finds nothing to add
        assert again.list_calls("p0") == [before, new]
    engine.dispose()
