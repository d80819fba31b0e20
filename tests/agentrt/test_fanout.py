"""The fan-out case of issue 47 (`agentrt bench fanout`): short programs that arrive while two tree searches fan
out over every seat. A program-level policy serves them ahead of the trees' later calls; FCFS serves them behind
the calls that came first. Before the queue boundaries were fitted to the calls' service (agentrt/policies/_fit.py),
a tree's calls never left queue 0 on a fast CPU, where older programs go first, and PLAS lost to FCFS here."""

import anyio
import pytest

from agentrt.bench import fanout


def test_short_programs_overtake_a_fan_out(default_model_path):
    args = fanout.parse_args(["--policies", "fcfs,plas,atlas", "--model", str(default_model_path)])
    args.engine = {"dtype": "auto"}  # the machine's fastest (the suite's float32 makes each short call's own steps slow)
    report = fanout.run(args)
    fcfs = report["results"]["fcfs"]
    assert fcfs["programs_done"] == fcfs["programs"] == 8
    for policy in ("plas", "atlas"):
        mine = report["results"][policy]
        assert mine["programs_done"] == mine["programs"] == 8
        # the contention the case assumes: under FCFS the short programs queue behind the trees' calls
        assert fcfs["short_queued_s"] > 2 * mine["short_queued_s"], policy
        assert mine["short_mean_s"] <= 0.5 * fcfs["short_mean_s"], (policy, report["results"])
        assert mine["makespan_s"] <= 1.5 * fcfs["makespan_s"], policy  # the trees are not starved for it


def test_fanout_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        fanout.parse_args(["--rounds", "1"])
    with pytest.raises(SystemExit):
        fanout.parse_args(["--policies", "fcfs,nope"])
    with pytest.raises(SystemExit):
        fanout.parse_args(["--policy-kwargs", "[1]"])
