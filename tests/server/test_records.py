"""A server owns its records: its own default database per served model; after a SIGKILL the programs it
left running are `interrupted` at the next start (a real `agentrt serve`, on SQLite and PostgreSQL); a
DELETE always leaves a program ended; the program and call lists page (`limit`, `after`, `has_more`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agentrt.server.store import CallRecord, ProgramRecord, Store, default_url
from agentrt.server.ui import PAGE
from tests.server.live import free_port, live_server, tiny_config, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        yield None  # the server's default file, under AGENTRT_CACHE_DIR
        return
    from tests.server.pg import create_database, drop_database

    url = create_database(request.getfixturevalue("postgres_url"))
    yield url
    drop_database(url)


class Serve:
    """`agentrt serve` as a child process, its stdout and stderr in a file (a full pipe would stall it)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "agentrt.cli", "serve", *args, "--port", str(self.port), "--log-level", "warning"]
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        wait_healthy(self.proc, self.url, log)

    def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(60)


def _wait_for(store: Store, pid: str, state: str) -> None:
    deadline = time.monotonic() + 30
    while (rec := store.get_program(pid)) is None or rec.state != state:
        assert time.monotonic() < deadline, f"{pid} never recorded as {state}: {rec}"
        time.sleep(0.05)


def test_a_killed_servers_running_programs_are_interrupted_at_restart(tiny_model_path, tmp_path, db_url):
    env = {k: v for k, v in os.environ.items() if k != "AGENTRT_DB"} | {"AGENTRT_CACHE_DIR": str(tmp_path / "cache")}
    args = ["--model", str(tiny_model_path), "--served-model-name", "tiny", "--num-blocks", "64"]
    args += [] if db_url is None else ["--db", db_url]
    url = db_url or f"sqlite:///{tmp_path}/cache/records/tiny.db"  # the default: one file per served model

    first = Serve(args, env, tmp_path / "first.log")
    try:
        with httpx.Client(base_url=first.url, timeout=60) as http:
            for pid in ("crashed", "done"):
                assert http.post("/v1/programs", json={"program_id": pid}).status_code == 201
            r = http.post("/v1/chat/completions", headers={"X-Program-Id": "crashed"},
                          json={"messages": HI, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert http.delete("/v1/programs/done").json()["state"] == "finished"
        with Store(url) as store:
            _wait_for(store, "crashed", "running")
            _wait_for(store, "done", "finished")
        killed_at = time.time()
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    finally:
        first.proc.kill()
        first.proc.wait()

    second = Serve(args, env, tmp_path / "second.log")
    try:
        found_by = time.time()
        with httpx.Client(base_url=second.url, timeout=60) as http:
            crashed = http.get("/v1/programs/crashed").json()
            assert (crashed["state"], crashed["live"], crashed["calls_done"]) == ("interrupted", False, 1)
            assert killed_at <= crashed["ended_at"] <= found_by
            assert crashed["error"] == "the server stopped while this program ran"
            listed = http.get("/v1/programs").json()
            assert [(p["id"], p["state"]) for p in listed["data"]] == [("done", "finished"), ("crashed", "interrupted")]
            assert http.get("/v1/programs?state=running").json()["data"] == []
            r = http.delete("/v1/programs/crashed")
            assert r.status_code == 200 and r.json()["state"] == "interrupted"
        assert second.stop(signal.SIGTERM) == 0
    finally:
        second.proc.kill()
        second.proc.wait()
    log = second.log.read_text()
    assert "1 programs a previous run left running are now 'interrupted'" in log, log
    assert "agentrt engine: " in log and "policy plas" in log and "KV blocks" in log, log  # the start-up line
    assert "Traceback" not in log, log


def test_the_default_database_is_the_served_models_own(monkeypatch, tmp_path):
    monkeypatch.delenv("AGENTRT_DB", raising=False)
    monkeypatch.setenv("AGENTRT_CACHE_DIR", str(tmp_path))
    assert default_url("tiny") == f"sqlite:///{tmp_path}/records/tiny.db"
    assert default_url("org/Model-1.5B") == f"sqlite:///{tmp_path}/records/org_Model-1.5B.db"
    assert default_url("..") == f"sqlite:///{tmp_path}/records/_.db"
    monkeypatch.setenv("AGENTRT_DB", "postgresql://u@h/db")
    assert default_url("tiny") == "postgresql://u@h/db"  # an explicit database is taken as it is


def test_delete_ends_a_program_recorded_running_that_nobody_runs(tiny_model_path, tmp_path):
    db = f"sqlite:///{tmp_path}/records.db"
    with live_server(tiny_config(tiny_model_path, db=db)) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        with Store(db) as other_writer:  # a record no start-up saw: written behind the server's back
            other_writer.put_program(ProgramRecord("ghost", None, "g", None, "running", "plas", time.time() - 5))
        assert http.get("/v1/programs/ghost").json()["state"] == "running"
        before = time.time()
        r = http.delete("/v1/programs/ghost")
        assert r.status_code == 200, r.text
        assert (r.json()["state"], r.json()["live"]) == ("interrupted", False)
        assert before <= r.json()["ended_at"] <= time.time()
        assert http.get("/v1/programs/ghost").json()["state"] == "interrupted"


def test_program_and_call_lists_page(tiny_model_path, tmp_path):
    db = f"sqlite:///{tmp_path}/records.db"
    with Store(db) as store:  # an earlier run's programs, older than any live one
        for i in range(5):
            store.put_program(ProgramRecord(f"old{i}", None, "old", None, "finished", "plas", 1000.0 + i, 1001.0 + i))
    with live_server(tiny_config(tiny_model_path, db=db)) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        for i in range(3):
            assert http.post("/v1/programs", json={"program_id": f"new{i}"}).status_code == 201
            time.sleep(0.01)
        pages, after = [], None
        while True:
            page = http.get("/v1/programs", params={"limit": 3, **({"after": after} if after else {})}).json()
            pages.append([p["id"] for p in page["data"]])
            assert (page["first_id"], page["last_id"]) == (pages[-1][0], pages[-1][-1])
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert pages == [["new2", "new1", "new0"], ["old4", "old3", "old2"], ["old1", "old0"]]
        finished = http.get("/v1/programs", params={"state": "finished", "limit": 2, "after": "old3"}).json()
        assert ([p["id"] for p in finished["data"]], finished["has_more"]) == (["old2", "old1"], True)
        r = http.get("/v1/programs", params={"after": "nope"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "after"

        for _ in range(3):
            r = http.post("/v1/chat/completions", headers={"X-Program-Id": "new0"},
                          json={"messages": HI, "max_tokens": 1})
            assert r.status_code == 200, r.text
        first = http.get("/v1/programs/new0/calls", params={"limit": 2}).json()
        assert len(first["data"]) == 2 and first["has_more"] and first["last_id"] == first["data"][1]["id"]
        rest = http.get("/v1/programs/new0/calls", params={"limit": 2, "after": first["last_id"]}).json()
        assert len(rest["data"]) == 1 and not rest["has_more"]
        every = http.get("/v1/programs/new0/calls").json()["data"]
        assert [c["id"] for c in every] == [c["id"] for c in first["data"] + rest["data"]]
        r = http.get("/v1/programs/new0/calls", params={"after": "nope"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "after"


def test_interrupt_running_closes_programs_and_unfinished_calls():
    with Store("sqlite://") as store:
        store.put_program(ProgramRecord("p", None, "p", None, "running", "plas", 1.0))
        store.put_program(ProgramRecord("q", None, "q", None, "finished", "plas", 1.0, 2.0))
        store.put_call(CallRecord("r", "p", None, "chat", 1.0))
        store.put_call(CallRecord("s", "p", None, "chat", 1.5, finished_at=2.0, num_prompt_tokens=3,
                                  num_output_tokens=4, service_s=0.5, finish_reason="stop"))
        assert store.interrupt_running(5.0) == 1
        p, q = store.get_program("p"), store.get_program("q")
        assert (p.state, p.ended_at, q.state, q.ended_at) == ("interrupted", 5.0, "finished", 2.0)
        assert (p.calls_done, p.num_prompt_tokens, p.num_output_tokens, p.service_s) == (1, 3, 4, 0.5)
        assert [(c.finish_reason, c.finished_at) for c in store.list_calls("p")] == [("interrupted", 5.0),
                                                                                    ("stop", 2.0)]


def test_the_live_page_counts_only_live_programs_as_running():
    assert 'programs.filter((p) => p.live && p.state === "running")' in PAGE


def test_call_ids_number_each_programs_calls(tiny_model_path, tmp_path):
    """A program's first call is `{id}-c1`, whatever other programs called before; an id started again after
    its program ended goes on counting, so no two calls share an id (the store keys calls by it)."""
    with live_server(tiny_config(tiny_model_path, db=f"sqlite:///{tmp_path}/records.db")) as s, \
            httpx.Client(base_url=s.url, timeout=60) as http:
        def call(pid: str) -> None:
            r = http.post("/v1/chat/completions", headers={"X-Program-Id": pid}, json={"messages": HI, "max_tokens": 1})
            assert r.status_code == 200, r.text

        def ids(pid: str) -> list[str]:
            return [c["id"] for c in http.get(f"/v1/programs/{pid}/calls").json()["data"]]

        for pid in ("ids-a", "ids-b", "ids-a", "ids-c"):
            call(pid)
        assert (ids("ids-a"), ids("ids-b"), ids("ids-c")) == (["ids-a-c1", "ids-a-c2"], ["ids-b-c1"], ["ids-c-c1"])
        assert http.delete("/v1/programs/ids-a").json()["state"] == "finished"
        call("ids-a")  # the id again: a new program
        assert http.get("/v1/programs/ids-a").json()["calls_done"] == 1
        assert ids("ids-a") == ["ids-a-c1", "ids-a-c2", "ids-a-c3"]
