"""The retention benchmark runs end to end (tiny model, a few agents) and checks its arguments."""

from __future__ import annotations

import json

import pytest

from agentrt.bench import retention as bench
from agentrt.policies.autellix import TTL_SETTINGS


def test_bench_retention_smoke(tiny_model_path, capsys):
    argv = ["--model", str(tiny_model_path), "--programs", "3", "--rate", "20", "--num-blocks", "48",
            "--policies", "fcfs,plas", "--modes", "lru,lru+admission,ttl", "--task-tokens", "40",
            "--tool-median-s", "0.05", "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"]["task"] == 40 and report["workload"]["tool_median_s"] == 0.05
    rows = {(r["policy"], r["mode"]): r for r in report["results"]}
    assert set(rows) == {(p, m) for p in ("fcfs", "plas") for m in ("lru", "lru+admission", "ttl")}
    # pins run each policy composed with TTL; the ablation has the same arguments without pins
    assert rows["plas", "ttl"]["policy_kwargs"] == TTL_SETTINGS == rows["plas", "lru+admission"]["policy_kwargs"]
    assert rows["fcfs", "ttl"]["policy_kwargs"] == {"pinned_first": True, "protect_pins": True}
    assert rows["plas", "lru"]["policy_kwargs"] == {} == rows["fcfs", "lru"]["policy_kwargs"]
    for r in rows.values():
        assert r["programs"] == 3 and r["recomputed_prefill_tokens"] >= 0 and 0 <= r["prefix_hit_rate"] <= 1
        assert r["latency_p95_s"] > 0 and r["makespan_s"] > 0
        if r["mode"] != "ttl":
            assert r["ttl_hits"] == r["ttl_misses"] == 0  # no pins without TTL
    assert "| plas | ttl |" in bench.table(report["results"])


@pytest.mark.parametrize(("argv", "needle"), [
    (["--modes", "lru,forever"], "unknown mode 'forever'"),
    (["--tool-median-s", "0"], "--tool-median-s"),
    (["--task-tokens", "0"], "--task-tokens"),
])
def test_bench_retention_rejects_bad_arguments(argv, needle):
    with pytest.raises(SystemExit, match=needle):
        bench.main(argv)
