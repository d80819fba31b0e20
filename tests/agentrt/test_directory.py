"""The program directory (agentrt.scale.directory) on constructed views: merged records, service elsewhere,
DELETE everywhere, dead replicas, restarts, bounds, and the merged /metrics exposition."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from agentrt.scale.directory import ProgramDirectory, merge_expositions
from agentrt.server.program_schemas import Program


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def view(pid: str, *, state: str = "running", created: float = 100.0, done: int = 1, service: float = 1.0,
         running: int = 0, kv: int = 0, owner: str | None = None, level: int | None = None, **kw) -> dict:
    v = msgspec.to_builtins(Program(
        id=pid, name="agent", state=state, created_at=created, ended_at=None if state == "running" else created + 5,
        calls_waiting=0, calls_running=running, calls_done=done, service_s=service, critical_path_s=service,
        wait_s=0.1, num_prompt_tokens=10 * done, num_output_tokens=2 * done, queue_level=level, kv_blocks=kv,
        num_threads=1, **kw))
    v["owner"] = owner
    return v


def test_a_program_on_two_replicas_is_one_record_and_each_sees_the_others_service():
    d = ProgramDirectory(clock=Clock())
    d.sync("r1", [view("p", done=3, service=6.0, running=1, kv=4, level=1)], ["p"])
    out = d.sync("r2", [view("p", created=101.0, done=1, service=0.5, kv=2, level=0)], ["p"])
    assert out["programs"]["p"] == {"service_s": 6.0, "critical_path_s": 6.0, "end": False}
    assert d.sync("r1", [], ["p"])["programs"]["p"]["service_s"] == 0.5
    merged = d.program("p", None)
    assert merged["calls_done"] == 4 and merged["service_s"] == 6.5 and merged["num_prompt_tokens"] == 40
    assert merged["calls_running"] == 1 and merged["kv_blocks"] == 6 and merged["queue_level"] == 0
    assert merged["created_at"] == 100.0 and merged["state"] == "running" and merged["replicas"] == ["r1", "r2"]
    assert "owner" not in merged
    msgspec.convert(merged, Program)  # the API's schema, as a single server's
    assert d.sync("r3", [], ["p", "unknown"])["programs"]["p"]["service_s"] == 6.5  # a new home gets it all


def test_owner_keeps_other_keys_out():
    d = ProgramDirectory(clock=Clock())
    d.sync("r1", [view("p", owner="k1")])
    assert d.program("p", "k2") is None and d.end("p", "k2") is None and d.page("k2", None, 10) == []
    assert d.program("p", "k1")["id"] == "p"
    assert d.claim("p", "k2") == {"owner": "k1", "service_s": 1.0, "critical_path_s": 1.0}  # refused: k1's
    assert d.claim("q", "k2")["owner"] == "k2"  # the first claim owns it before any replica syncs it
    assert d.claim("q", "k1")["owner"] == "k2"
    assert d.known(["p", "q"]) == ["p"] and d.program("q", "k2") is None  # claimed: no record to show yet
    d.sync("r1", [view("p", owner="k1", state="finished")])
    assert d.claim("p", "k2")["owner"] == "k2"  # ended everywhere: the id is free again


def test_delete_ends_it_everywhere_and_a_restarted_id_is_new():
    clock = Clock()
    d = ProgramDirectory(clock=clock)
    d.sync("r1", [view("p", running=1)], ["p"])
    d.sync("r2", [view("p", created=101.0)], ["p"])
    d.sync("r1", [view("p", state="finished")], [])  # the replica that took the DELETE ended it there
    ended = d.end("p", None)
    assert ended["state"] == "finished" and ended["ended_at"] == clock.t and ended["calls_running"] == 0
    assert d.sync("r2", [], ["p"])["programs"]["p"]["end"] is True  # r2 ends its copy on its next sync
    assert d.sync("r1", [], [])["programs"] == {}
    d.sync("r2", [view("p", created=101.0, state="finished")], [])
    assert d.sync("r2", [], [])["programs"] == {}
    assert d.end("p", None)["ended_at"] == ended["ended_at"]  # ending an ended program: its record
    clock.t += 10
    d.sync("r2", [view("p", created=clock.t, done=1, service=0.25)], ["p"])  # the id started again
    again = d.program("p", None)
    assert again["state"] == "running" and again["service_s"] == 0.25 and again["replicas"] == ["r2"]


def test_a_dead_replica_keeps_the_service_it_gave_but_not_the_calls_it_held():
    clock = Clock()
    d = ProgramDirectory(clock=clock, stale_s=10.0)
    d.sync("r1", [view("p", done=5, service=9.0, running=2, kv=7)], ["p"])
    clock.t += 11  # r1 died: no sync since
    out = d.sync("r2", [view("p", done=1, service=1.0)], ["p"])
    assert out["programs"]["p"]["service_s"] == 9.0  # PLAS on r2 orders it by all it received
    merged = d.program("p", None)
    assert merged["service_s"] == 10.0 and merged["calls_done"] == 6
    assert merged["calls_running"] == 0 and merged["kv_blocks"] == 0


def test_a_restarted_directory_has_a_new_epoch():
    a, b = ProgramDirectory(), ProgramDirectory()
    assert a.sync("r", [])["epoch"] != b.sync("r", [])["epoch"]


def test_bounded_and_paged_newest_first():
    d = ProgramDirectory(max_programs=5, clock=Clock())
    d.sync("r1", [view(f"p{i}", created=100.0 + i) for i in range(8)])
    assert len(d.programs) == 5 and d.known(["p0", "p3"]) == ["p3"]
    page = d.page(None, None, 2)
    assert [v["id"] for v in page] == ["p7", "p6"]
    assert [v["id"] for v in d.page(None, None, 10, before=(106.0, "p6"))] == ["p5", "p4", "p3"]
    assert d.page(None, "finished", 10) == []
    for gone in range(20):  # replicas that stopped syncing long ago are forgotten
        d.sync(f"old{gone}", [])
    d.clock.t += 1000
    d.sync("r1", [])
    assert set(d.seen) == {"r1"}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["r1", "r2", "r3"]), st.integers(0, 20),
                          st.floats(0, 100, allow_nan=False)), min_size=1, max_size=30))
def test_merged_service_is_the_sum_of_each_replicas_latest(syncs):
    d = ProgramDirectory(clock=Clock())
    latest: dict[str, float] = {}
    for replica, done, service in syncs:
        d.sync(replica, [view("p", done=done, service=service)], ["p"])
        latest[replica] = service
        assert d.program("p", None)["service_s"] == pytest.approx(sum(latest.values()))
        for r in latest:
            elsewhere = d.sync(r, [], ["p"])["programs"]["p"]["service_s"]
            assert elsewhere == pytest.approx(sum(v for k, v in latest.items() if k != r))


EXPOSITION = """# HELP agentrt:num_requests_running Requests being decoded.
# TYPE agentrt:num_requests_running gauge
agentrt:num_requests_running 2.0
# HELP agentrt:calls_per_level Calls in each queue level.
# TYPE agentrt:calls_per_level gauge
agentrt:calls_per_level{level="0"} 1.0
# HELP agentrt:e2e_request_latency_seconds Latency.
# TYPE agentrt:e2e_request_latency_seconds histogram
agentrt:e2e_request_latency_seconds_bucket{le="1.0"} 3.0
agentrt:e2e_request_latency_seconds_bucket{le="+Inf"} 4.0
agentrt:e2e_request_latency_seconds_count 4.0
agentrt:e2e_request_latency_seconds_sum 2.5
"""


def test_metrics_of_all_replicas_in_one_exposition_labelled_by_replica():
    text = merge_expositions({"r1": EXPOSITION, "r2": EXPOSITION.replace("running 2.0", "running 5.0")})
    families = {f.name: f for f in text_string_to_metric_families(text)}  # valid: each family once
    running = {s.labels["replica"]: s.value for s in families["agentrt:num_requests_running"].samples}
    assert running == {"r1": 2.0, "r2": 5.0}
    levels = families["agentrt:calls_per_level"].samples
    assert {(s.labels["replica"], s.labels["level"]) for s in levels} == {("r1", "0"), ("r2", "0")}
    hist = families["agentrt:e2e_request_latency_seconds"].samples
    assert len(hist) == 8 and {s.labels["replica"] for s in hist} == {"r1", "r2"}
    assert text.count("# TYPE agentrt:num_requests_running gauge") == 1
    assert merge_expositions({}) == ""


def test_directory_metrics_drop_replicas_that_stopped():
    clock = Clock()
    d = ProgramDirectory(clock=clock, stale_s=5.0)
    d.metrics("r1", EXPOSITION)
    clock.t += 6
    text = d.metrics("r2", EXPOSITION)
    assert 'replica="r2"' in text and 'replica="r1"' not in text
