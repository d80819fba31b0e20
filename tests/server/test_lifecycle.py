"""The server's life: a SIGTERM drains in-flight streams, refuses new connections, flushes every
record and exits 0; programs outlive a restart in the database (SQLite and PostgreSQL), with their
owner."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agentrt.server.store import Store
from tests.server.live import Stream, free_port, live_server, tiny_config, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
HI = [{"role": "user", "content": "hi"}]
DRAIN_TIMEOUT_S = 20
NUM_TOKENS = 256


def _refused(url: str) -> bool:
    """A new request is refused: the connection refused, closed before any response (uvicorn's
    shut-down closes connections that have no request in progress), or answered 503."""
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 503
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        return True


def test_sigterm_drains_in_flight_streams_and_flushes_records(tiny_model_path, tmp_path):
    port, db = free_port(), f"sqlite:///{tmp_path}/a.db"
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "agentrt.cli", "serve", "--model", str(tiny_model_path), "--port", str(port),
           "--num-blocks", "256", "--db", db, "--drain-timeout", str(DRAIN_TIMEOUT_S), "--log-level", "warning"]
    log = tmp_path / "serve.log"  # a file, not a pipe: a full pipe would stall the server
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, url, log)
        streams = [Stream(url, f"drain-{i}", NUM_TOKENS) for i in range(3)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.started.wait(60)
        proc.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        while not _refused(url):
            assert time.monotonic() - sigterm_at < 10, "new connections still accepted after SIGTERM"
            time.sleep(0.05)
        assert any(s.is_alive() for s in streams), "the streams ended before the drain began: nothing was tested"

        for s in streams:
            s.join(DRAIN_TIMEOUT_S)
            assert s.error is None, f"{s.program_id}: {s.error!r}"
            assert s.events[-1] == "[DONE]"
            chunks = s.chunks()
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
            assert chunks[-1]["usage"]["completion_tokens"] == NUM_TOKENS
        rc = proc.wait(DRAIN_TIMEOUT_S)
        output = log.read_text()
        assert rc == 0, output
        assert time.monotonic() - sigterm_at < DRAIN_TIMEOUT_S
        assert "Traceback" not in output, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    with Store(db) as store:
        for s in streams:
            (call,) = store.list_calls(s.program_id)
            assert (call.finish_reason, call.num_output_tokens, call.error) == ("length", NUM_TOKENS, None)
            prog = store.get_program(s.program_id)
            # programs keyed by id end when the runtime stops: after their calls were drained
            assert (prog.state, prog.calls_done, prog.num_output_tokens) == ("cancelled", 1, NUM_TOKENS)
            assert prog.ended_at is not None


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/programs.db"
        return
    from tests.server.pg import create_database, drop_database

    url = create_database(request.getfixturevalue("postgres_url"))
    yield url
    drop_database(url)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_programs_outlive_a_restart_with_their_owner(tiny_model_path, db_url):
    config = tiny_config(tiny_model_path, db=db_url, api_keys=["k1", "k2"])
    k1 = {**_auth("k1"), "X-Program-Id": "p1"}
    with live_server(config) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        usage = []
        for _ in range(2):
            body = {"messages": HI, "max_tokens": 5, "ignore_eos": True}
            r = http.post("/v1/chat/completions", headers=k1, json=body)
            assert r.status_code == 200, r.text
            usage.append(r.json()["usage"])
        live_calls = http.get("/v1/programs/p1/calls", headers=_auth("k1")).json()["data"]
        assert [(c["kind"], c["completion_tokens"]) for c in live_calls] == [("chat", 5), ("chat", 5)]
        r = http.delete("/v1/programs/p1", headers=_auth("k1"))
        assert r.status_code == 200, r.text
        ended = r.json()
    assert (ended["state"], ended["calls_done"], ended["live"]) == ("finished", 2, True)
    assert ended["num_output_tokens"] == sum(u["completion_tokens"] for u in usage) == 10
    assert ended["num_prompt_tokens"] == sum(u["prompt_tokens"] for u in usage)

    with live_server(config) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        r = http.get("/v1/programs/p1", headers=_auth("k1"))
        assert r.status_code == 200, r.text
        stored = r.json()
        assert stored["live"] is False
        same = ("id", "name", "state", "calls_done", "num_prompt_tokens", "num_output_tokens", "error")
        assert {k: stored[k] for k in same} == {k: ended[k] for k in same}
        assert stored["ended_at"] == pytest.approx(ended["ended_at"], abs=0.5)
        listed = http.get("/v1/programs", headers=_auth("k1")).json()["data"]
        assert [(p["id"], p["live"], p["state"]) for p in listed] == [("p1", False, "finished")]

        r = http.get("/v1/programs/p1", headers=_auth("k2"))
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "program_not_found"
        assert http.get("/v1/programs", headers=_auth("k2")).json()["data"] == []
        assert http.delete("/v1/programs/p1", headers=_auth("k2")).status_code == 404

        calls = http.get("/v1/programs/p1/calls", headers=_auth("k1")).json()["data"]
        assert calls == live_calls  # the program's calls, from the store, in arrival order
        assert [(c["prompt_tokens"], c["completion_tokens"], c["finish_reason"]) for c in calls] == [
            (u["prompt_tokens"], u["completion_tokens"], "length") for u in usage]
        assert calls[0]["created_at"] <= calls[1]["created_at"] and all(c["service_s"] > 0 for c in calls)
        assert http.get("/v1/programs/p1/calls?limit=1", headers=_auth("k1")).json()["data"] == calls[:1]
        assert http.get("/v1/programs/p1/calls", headers=_auth("k2")).status_code == 404
        assert http.get("/v1/programs/p1/calls?limit=0", headers=_auth("k1")).json()["error"]["param"] == "limit"


def test_program_calls_need_a_store(tiny_model_path):
    with live_server(tiny_config(tiny_model_path)) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        assert http.post("/v1/chat/completions", headers={"X-Program-Id": "p"},
                         json={"messages": HI, "max_tokens": 2}).status_code == 200
        r = http.get("/v1/programs/p/calls")
        assert r.status_code == 409 and "--db none" in r.json()["error"]["message"]
        assert http.get("/v1/programs/nope/calls").status_code == 404
