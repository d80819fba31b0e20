"""agentrt/bench/breakdown.py on a hand-made step log: each call's parts add up to its latency and land where they belong."""

from __future__ import annotations

import pytest

from agentrt.bench import breakdown as bd
from agentrt.bench.costs import StepCost


class Log(bd.StepLog):
    def __init__(self, steps):
        self.steps = steps


def test_parts_add_up_and_split_by_row_kind():
    cost = StepCost(base_s=0.010, token_s=0.001, decode_row_s=0.0, context_s=0.0, prefill_attn_s=0.0, sample_s=0.0)
    # step 1 (t 1.0): a's decode row and b's 20-token prefill chunk: predicted 10 + 1 + 20 = 31 ms, measured 62 ms
    # step 2 (t 1.1): a alone: predicted 11 ms, measured 11 ms; step 3 (t 1.2) ends step 2 (its time unknown)
    steps = [(1.0, 0.0, [("a", "pa", 1, 10, 12, 0.5), ("b", "pb", 20, 0, 21, 0.9)]),
             (1.1, 0.062, [("a", "pa", 1, 11, 12, 0.5)]),
             (1.2, 0.073, [("c", "pc", 1, 0, 1, 1.2)])]
    calls = bd.call_parts(Log(steps), cost)
    a, b = calls["a"], calls["b"]
    assert set(calls) == {"a", "b"}  # the last step's duration is unknown
    assert a["latency"] == pytest.approx(0.7) and a["queue"] == pytest.approx(0.5) and a["steps"] == 2
    assert a["own"] == pytest.approx(2 * 0.011 + 0.011)  # 11 ms alone, doubled in step 1 by the measured / predicted scale
    assert a["prefill"] == pytest.approx(0.040) and a["width"] == pytest.approx(0.0)  # b's chunk, scaled
    assert b["own"] == pytest.approx(0.060) and b["width"] == pytest.approx(0.002) and b["prefill"] == 0.0
    for rec in calls.values():
        assert sum(rec[p] for p in bd.PARTS) == pytest.approx(rec["latency"])
    programs = {"pa": {"kind": "react", "latency_s": 1.0}, "pb": {"kind": "tree", "latency_s": 0.5}}
    cls = bd.by_class(calls, programs, ("tree",))
    assert cls["short"]["programs"] == 1 and cls["short"]["tools_client"] == pytest.approx(0.3)
    assert cls["long"]["width_rows"] == pytest.approx(2.0) and cls["short"]["width_rows"] == pytest.approx(1.5)
    assert "| react" not in bd.table({"p": {"breakdown": cls}}) and "| p | short | 1.00 |" in bd.table({"p": {"breakdown": cls}})
