"""The program benchmark runs end to end (tiny model, a handful of programs) and edits only its section."""

from __future__ import annotations

import json

from bench import programs as bench


def test_bench_programs_smoke(tiny_model_path, tmp_path, capsys):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Kernels\n\nkeep me\n\n## Program scheduling\n\nold\n\n## Later\n\nkeep too\n")
    argv = ["--model", str(tiny_model_path), "--programs", "4", "--rate", "20", "--policies", "fcfs,plas"]
    assert bench.main([*argv, "--json", "--docs", str(docs)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["results"]) == ["fcfs", "plas"]
    plas = report["results"]["plas"]
    assert plas["latency_s"]["n"] == 4 and plas["vs_fcfs"]["latency_s.mean"] > 0
    assert all(p["output_tokens"] > 0 and p["calls"] >= 1 for p in plas["programs"])
    text = docs.read_text()
    assert "keep me" in text and "keep too" in text and "old" not in text
    assert text.count("## Program scheduling") == 1 and "| plas |" in text


def test_workload_is_seeded():
    a, b = bench.make_workload(20, 0.5, seed=3), bench.make_workload(20, 0.5, seed=3)
    assert a == b and {s.kind for s in a} <= set(bench.PROGRAMS)
    assert all(x.arrival_s < y.arrival_s for x, y in zip(a, a[1:]))


def test_policy_entries_with_overrides():
    import argparse

    import pytest

    args = argparse.Namespace(first_boundary=None, quantum=None, beta=3.0)
    assert bench.policy_spec("plas", args) == ("plas", {"beta": 3.0})  # the command-line value
    assert bench.policy_spec("plas:np:beta=2", args) == ("plas", {"beta": 2.0, "preempt": False})
    assert bench.policy_spec("mlfq", args) == ("mlfq", {})  # beta means nothing to mlfq
    assert bench.policy_spec("fcfs", args) == ("fcfs", {})
    assert bench.policy_spec("atlas:num_queues=8:order=call:live=off", args) == (
        "atlas", {"beta": 3.0, "num_queues": 8, "order": "call", "live": False})
    for bad, message in [("plas:fast", "unknown policy variant 'fast'"), ("fcfs:beta=2", "nothing for fcfs"),
                         ("atlas:beta=high", "beta must be float, got 'high'"),
                         ("plas:num_queues=2.5", "num_queues must be int"),
                         ("plas:live=maybe", r"live must be a flag \(1/0, true/false\), got 'maybe'"),
                         ("mlfq:order=call", "unknown policy variant 'order=call'")]:
        with pytest.raises(SystemExit, match=message):
            bench.policy_spec(bad, args)
