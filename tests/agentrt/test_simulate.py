"""The scheduling simulator: the engine's scheduler and policies on a virtual clock."""

from __future__ import annotations

import json

import pytest

from agentrt.bench import simulate as sim
from agentrt.bench import workload as wl
from agentrt.engine.request import Request
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.scheduler import SchedulerOutput


@pytest.fixture(autouse=True)
def _no_stored_fit(tmp_path, monkeypatch):
    """The built-in step costs, whatever fit this machine has stored (tests/agentrt/test_calibrate.py covers fits)."""
    monkeypatch.setenv("AGENTRT_CALIBRATION_DIR", str(tmp_path))


def _calls_ok(kind: str, calls: int) -> bool:
    if kind == "react":
        return wl.REACT["calls"][0] <= calls <= wl.REACT["calls"][1]
    return calls == {"chat": 1, "tree": 2 + wl.TREE["width"] * wl.TREE["depth"]}[kind]


@pytest.mark.parametrize("policy", ["fcfs", "mlfq", "plas", "atlas"])
def test_every_program_runs_its_plan_and_all_blocks_come_back(policy):
    work = wl.make_workload(24, 0.5, seed=1)
    res = sim.simulate(policy, work)  # asserts inside: no leaked block, no unfinished program
    assert len(res["programs"]) == 24
    for spec, prog in zip(work, res["programs"]):
        assert prog["kind"] == spec.kind and _calls_ok(spec.kind, prog["calls"])
        assert prog["latency_s"] > 0
    assert res["makespan_s"] >= max(s.arrival_s for s in work)
    assert 0 < res["utilization"] <= 1


def test_deterministic_and_policies_differ():
    work = wl.make_workload(32, 0.3, seed=0)
    a, b = sim.simulate("plas", work), sim.simulate("plas", work)
    assert a == b
    fcfs = sim.simulate("fcfs", work)
    chats = {name: [p["latency_s"] for p in r["programs"] if p["kind"] == "chat"] for name, r in (("fcfs", fcfs), ("plas", a))}
    assert sum(chats["plas"]) < 0.5 * sum(chats["fcfs"])  # chats overtake the tree searches' fan-outs
    assert fcfs["preemptions"] == 0 and a["preemptions"] > 0


def test_step_cost_model():
    cost = sim.StepCost(base_s=0.05, token_s=0.002, decode_row_s=0.004, context_s=1e-5)
    assert cost(SchedulerOutput([], [], [])) == 0.0
    prefill = Request("a", [1] * 100, SamplingParams())
    decode = Request("b", [1] * 10, SamplingParams())
    decode.num_computed_tokens = 9
    out = SchedulerOutput([prefill, decode], [100, 1], [])
    assert cost(out) == pytest.approx(0.05 + 0.002 * 101 + 0.004 * 1 + 1e-5 * (100 + 10))


def test_capacity_is_the_burst_throughput():
    work = wl.make_workload(16, 0.1, seed=2)
    cap = sim.capacity(work)
    burst = [wl.ProgramSpec(s.index, s.kind, 0.0, s.seed) for s in work]
    assert cap == pytest.approx(16 / sim.simulate("fcfs", burst)["makespan_s"])
    assert cap > 0


def test_cli_reports_ratios_and_capacity(capsys):
    assert sim.main(["--programs", "12", "--rate", "0.4", "--policies", "fcfs,plas:order=call", "--json", "--capacity"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["results"]) == ["fcfs", "plas:order=call"]
    assert report["results"]["plas:order=call"]["vs_fcfs"]["latency_s.mean"] > 0
    assert report["capacity_programs_per_s"] > 0
    with pytest.raises(SystemExit, match="--cost must be 4 to 7 numbers"):
        sim.main(["--cost", "1,2"])
    with pytest.raises(SystemExit, match="got '1,2,3,-4'"):
        sim.main(["--cost", "1,2,3,-4"])


def test_sweep_over_loads(capsys):
    argv = ["--programs", "10", "--policies", "fcfs,plas", "--loads", "0.5,1.0", "--seeds", "2"]
    assert sim.main(argv) == 0
    out = capsys.readouterr().out
    assert "| 0.50 |" in out and "| 1.00 |" in out and "plas mean / p99 vs fcfs" in out
    assert sim.main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["load"] for r in rows] == [0.5, 1.0] and rows[1]["rate"] > rows[0]["rate"] > 0
    assert set(rows[0]["vs_fcfs"]) == {"plas"} and rows[0]["vs_fcfs"]["plas"]["mean"] > 0
    for bad in (["--loads", "fast"], ["--loads", "0"], ["--loads", "1", "--seeds", "0"]):
        with pytest.raises(SystemExit):
            sim.main(bad)


def test_command_line_entry(capsys):
    import agentrt.command as cli

    assert cli.main(["simulate", "--programs", "6", "--rate", "1", "--policies", "fcfs,atlas"]) == 0
    assert "| atlas |" in capsys.readouterr().out
    assert cli.main(["bench", "nonsense"]) == 2


def test_like_http_programs_never_end_and_plas_still_fits_its_boundary_to_programs():
    """--like-http: no program says it ended (an OpenAI client just stops calling), pins as the server keeps them.
    PLAS then learns its program boundary from programs that went quiet; without that (quiet never presumed) the
    boundary stays in calls' worth, and a ReAct loop's third call sits in the long programs' queue."""
    from agentrt._retention import RetentionConfig
    from agentrt.policies import PLAS, _multilevel

    work = wl.make_workload(16, 0.5, seed=2)
    policies = []
    res = sim.simulate("plas", work, retention=RetentionConfig(), end_programs=False)  # asserts: blocks back, all done
    assert len(res["programs"]) == 16
    orig = PLAS.on_program_done
    quiet = _multilevel.MultiLevelPolicy.min_quiet_s, _multilevel.MultiLevelPolicy.default_quiet_s
    try:
        PLAS.on_program_done = lambda self, prog: policies.append(self) or orig(self, prog)
        sim.simulate("plas", work, retention=RetentionConfig(), end_programs=False)
        presumed = len(policies)
        policies.clear()
        _multilevel.MultiLevelPolicy.min_quiet_s = _multilevel.MultiLevelPolicy.default_quiet_s = float("inf")
        sim.simulate("plas", work, retention=RetentionConfig(), end_programs=False)
    finally:
        PLAS.on_program_done = orig
        _multilevel.MultiLevelPolicy.min_quiet_s, _multilevel.MultiLevelPolicy.default_quiet_s = quiet
    assert presumed >= 8  # enough for the program fit
    assert not policies  # never presumed finished, never ended during the run: the fit learns nothing
    assert sim.main(["--programs", "8", "--rate", "0.5", "--policies", "fcfs,plas", "--like-http", "--json"]) == 0


def test_a_cpu_host_tier_is_simulated_read_in_place():
    """`kv_host_gib` in the engine: the CPU engine's host tier, read in place (a T1 hit costs no load and no pool
    block), with a token's KV bytes from the default model's config."""
    from agentrt.bench import sim_run, sim_tiers

    tiers = sim_tiers.cpu_host(1.0)
    assert tiers.in_place and tiers.kv_bytes_per_token > 0
    assert tiers.host_tokens == 2**30 // tiers.kv_bytes_per_token and tiers.load_s_per_block(1, 16) == 0.0
    work = wl.make_workload(24, 2.0, seed=1)
    engine = {"num_blocks": 40, "max_num_seqs": 16}
    plain = sim_run.simulate("fcfs", work, engine=engine)  # asserts inside: no leaked block, every program done
    tiered = sim_run.simulate("fcfs", work, engine={**engine, "kv_host_gib": 1.0})
    assert not plain["tier_hits"] and tiered["tier_hits"]["host"] > 0
    assert tiered["preemptions"] <= plain["preemptions"]


def test_a_closed_loop_keeps_n_programs_in_flight_and_its_knee_is_measured_as_the_servers():
    """`in_flight=N`: N programs start at once and each that ends starts the next, whatever the arrival times say;
    `served_knee` measures output tokens a second per N as `bench programs --load` measures a server's."""
    from agentrt.bench import programs as bench
    from agentrt.bench import sim_run

    work = wl.make_workload(30, 2.0, seed=3)
    engine = {"num_blocks": 60, "max_num_seqs": 8}
    res = sim_run.simulate("fcfs", work, engine=engine, in_flight=3)  # asserts inside: no leaked block, all done
    progs = res["programs"]
    assert sorted(p["start_s"] for p in progs)[:3] == [0.0, 0.0, 0.0]
    for p in progs:  # at any program's start, at most 3 are in flight (itself included)
        assert sum(q["start_s"] <= p["start_s"] < q["end_s"] for q in progs) <= 3
        assert p["latency_s"] == pytest.approx(p["end_s"] - p["start_s"])
    later = sorted(p["start_s"] for p in progs)[3:]  # every later start is some program's end
    assert all(any(s == q["end_s"] for q in progs) for s in later)
    with pytest.raises(ValueError, match="in_flight must be a program count >= 1, got 0"):
        sim_run.simulate("fcfs", work, engine=engine, in_flight=0)

    knee = sim_run.served_knee(wl.make_workload(120, 1.0, seed=0), engine=engine, levels=(1, 4, 16))
    curve = knee["curve"]
    assert list(curve)[:2] == [1, 4] and all(v > 0 for v in curve.values())
    assert knee["output_tok_s"] == max(curve.values()) and curve[knee["in_flight"]] == knee["output_tok_s"]
    if len(curve) == 2:  # stopped early: only past the knee
        assert curve[4] < curve[1]
    report = {"config": {"saturation": {"curve": {4: {"output_tok_s": 88.4}, 8: {"output_tok_s": 103.2}}}},
              "simulated_knee": {"curve": {4: 95.9, 8: 92.0}}}
    assert bench.knee_line(report).endswith("FCFS): served 4: 88, 8: 103; simulated 4: 96, 8: 92.")


def test_a_call_submitted_during_a_step_arrives_when_it_fell_due(monkeypatch):
    """A tool that returns while a step runs: its program's next call reaches the scheduler after that step (as on a
    real engine) but was submitted when the tool returned, so retention learns the tool's own time as the gap (the
    gaps once came out a step's remainder longer, ~0.1 s at the median on issue 47's workload, and the TTLs chosen
    from them were mostly 0) and the request's arrival time is the tool's return."""
    from agentrt import _retention
    from agentrt._retention import RetentionConfig
    from agentrt.bench import sim_engine, sim_run

    planned, recorded, late = [], [], []
    tool_seconds = wl.tool_seconds
    monkeypatch.setattr(wl, "tool_seconds", lambda rng, size: planned.append(tool_seconds(rng, size)) or planned[-1])
    record = _retention.RetentionPolicy.record_duration
    monkeypatch.setattr(_retention.RetentionPolicy, "record_duration",
                        lambda self, tool, s: recorded.append(s) or record(self, tool, s))
    add = sim_engine.SimEngine.add

    def spy(self, call, pid, tid, on_done, arrival=None):
        late.append(self.now - (self.now if arrival is None else arrival))
        return add(self, call, pid, tid, on_done, arrival)

    monkeypatch.setattr(sim_engine.SimEngine, "add", spy)
    monkeypatch.setattr(wl, "MIX", dict(wl.AGENT_WAIT_MIX))
    work = wl.make_workload(16, 2.0, seed=5)
    sim_run.simulate("plas", work, engine={"num_blocks": 120, "max_num_seqs": 16, "max_num_batched_tokens": 512},
                     retention=RetentionConfig())
    assert len(recorded) == len(planned) > 20
    assert sorted(recorded) == pytest.approx(sorted(planned), abs=1e-9)
    assert min(late) >= 0 and max(late) > 0  # some calls fell due during a step and were added after it
