"""One program, two replicas, one record: two real servers on the tiny model joined by one program directory
(agentrt.scale.peers.ReplicaPeers over agentrt.scale.directory.ProgramDirectory in this process), as
`agentrt serve --replicas` joins its Ray replicas. Every series of /metrics labelled by its replica, a
program's record and attained service global, a DELETE on one replica ending it on the other, another
key's program refused on a replica it never ran on."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentrt.scale.directory import ProgramDirectory
from agentrt.scale.peers import LocalDirectory, ReplicaPeers
from agentrt.server.app import metrics_text
from tests.server.conftest import check_idle
from tests.server.live import live_server, tiny_config

KEYS = {"k1": {"Authorization": "Bearer k1"}, "k2": {"Authorization": "Bearer k2"}}


def chat(http: httpx.Client, pid: str, key: str = "k1", text: str = "Hi there.") -> dict:
    r = http.post("/v1/chat/completions", headers={**KEYS[key], "X-Program-Id": pid},
                  json={"model": "tiny", "max_tokens": 4, "temperature": 0,
                        "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def pair(tiny_model_path):
    directory = LocalDirectory(ProgramDirectory())
    config = dict(served_model_name="tiny", api_keys=["k1", "k2"])
    with live_server(tiny_config(tiny_model_path, **config)) as a, live_server(tiny_config(tiny_model_path, **config)) as b:
        loops = []
        for name, srv in (("a", a), ("b", b)):
            st = srv.state
            st.peers = ReplicaPeers(st, name, directory, interval_s=0.1, metrics_interval_s=0.2,
                                    render_metrics=lambda st=st: metrics_text(st))
            loops.append(asyncio.run_coroutine_threadsafe(st.peers.run(), srv.server.servers[0].get_loop()))
        with httpx.Client(base_url=a.url, timeout=60) as ha, httpx.Client(base_url=b.url, timeout=60) as hb:
            yield a, b, ha, hb
        for task in loops:
            task.cancel()
        for srv in (a, b):
            for info in srv.state.runtime.programs.running():  # their pins go with them
                srv.state.runtime.end_program(info.program_id)
            check_idle(srv)
            assert srv.state.peers.num_syncs > 0 and srv.state.peers.num_failures == 0


def wait_for(check, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


def test_a_programs_record_and_service_are_global(pair):
    a, b, ha, hb = pair
    chat(ha, "glob-1")
    chat(ha, "glob-1", text="And then?")
    here = a.state.runtime.programs["glob-1"].service_s
    assert here > 0
    # a's record reaches the directory within one sync interval (what "global" means: that fresh)
    wait_for(lambda: a.state.peers.sent.get("glob-1", (None, 0))[1] == 2 and a.state.peers.num_syncs > 2)
    chat(hb, "glob-1", text="Once more.")  # re-homed: its next call runs on b
    # b's PLAS ordered it by what a gave it: credited before the call was queued
    assert b.state.runtime.policy.programs["glob-1"].elsewhere == pytest.approx(here)
    # either replica answers with the one record: b (where the call ran, and where the front sends a program's
    # reads) at once, a within a sync interval
    for http in (hb, ha):
        p = wait_for(lambda: (q := http.get("/v1/programs/glob-1", headers=KEYS["k1"]).json())["calls_done"] == 3 and q,
                     timeout_s=0.01 if http is hb else 5.0)
        assert p["calls_done"] == 3 and p["replicas"] == ["a", "b"] and p["state"] == "running"
        assert p["service_s"] == pytest.approx(here + b.state.runtime.programs["glob-1"].service_s)
        listed = [q for q in http.get("/v1/programs", headers=KEYS["k1"]).json()["data"] if q["id"] == "glob-1"]
        assert len(listed) == 1 and listed[0]["calls_done"] == 3
    assert hb.get("/v1/programs/glob-1", headers=KEYS["k2"]).status_code == 404  # another key's


def test_delete_on_one_replica_ends_the_program_on_the_other(pair):
    a, b, ha, hb = pair
    chat(ha, "glob-2")
    chat(hb, "glob-2")
    r = ha.delete("/v1/programs/glob-2", headers=KEYS["k1"])
    assert r.status_code == 200 and r.json()["state"] == "finished" and r.json()["calls_running"] == 0
    wait_for(lambda: b.state.runtime.programs["glob-2"].state != "running")
    assert a.state.runtime.programs["glob-2"].state != "running"
    assert hb.get("/v1/programs/glob-2", headers=KEYS["k1"]).json()["state"] == "finished"


def test_another_keys_running_program_is_refused_on_a_replica_it_never_ran_on(pair):
    a, b, ha, hb = pair
    chat(ha, "glob-3", key="k1")
    r = hb.post("/v1/chat/completions", headers={**KEYS["k2"], "X-Program-Id": "glob-3"},
                json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] in (None, "program_id"), r.text
    assert "glob-3" not in b.state.runtime.programs


def test_metrics_carry_every_replica_labelled(pair):
    a, b, ha, hb = pair
    chat(hb, "glob-4")

    def both() -> dict | None:
        text = ha.get("/metrics", headers=KEYS["k1"]).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        fam = families.get("agentrt:request_success")
        replicas = {s.labels["replica"] for s in fam.samples} if fam else set()
        return families if replicas == {"a", "b"} else None

    families = wait_for(both)
    done = {s.labels["replica"]: s.value for s in families["agentrt:request_success"].samples
            if s.name.endswith("_total")}
    assert done["b"] >= 1


class Unreachable:
    def __getattr__(self, name):
        async def call(*args, **kwargs):
            raise ConnectionError("directory actor is dead")

        return call


def test_without_the_directory_calls_are_served_and_reads_say_why(pair):
    a, b, ha, hb = pair
    peers = b.state.peers
    directory, failures = peers.directory, peers.num_failures
    peers.directory = Unreachable()
    try:
        chat(hb, "glob-5")  # served: this replica checks its own owners meanwhile
        r = hb.get("/v1/programs/glob-5", headers=KEYS["k1"])
        assert r.status_code == 503 and r.json()["error"]["code"] == "directory_unavailable"
        assert "directory actor is dead" in r.json()["error"]["message"]
        text = hb.get("/metrics", headers=KEYS["k1"]).text  # this replica's own series, labelled
        assert 'replica="b"' in text and 'replica="a"' not in text
    finally:
        peers.directory = directory
    p = wait_for(lambda: (q := hb.get("/v1/programs/glob-5", headers=KEYS["k1"])).status_code == 200 and q.json())
    assert p["calls_done"] == 1 and p["replicas"] == ["b"]
    peers.num_failures = failures  # the fixture checks the loop never failed otherwise
