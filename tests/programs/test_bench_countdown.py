"""`agentrt bench countdown` end to end on a tiny random model (the plumbing; the numbers in
docs/benchmarks.md come from the real model)."""

from __future__ import annotations

import json

from agentrt.command import main as cli


def test_countdown_bench_runs_every_method_at_equal_budgets(tiny_model_path, capsys):
    assert cli(["bench", "countdown", "--model", str(tiny_model_path), "--puzzles", "2", "--budgets", "2,3",
                "--width", "2", "--max-tokens", "8", "--step-tokens", "6", "--no-docs", "--json"]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out[: out.rindex("}") + 1])["rows"]
    assert [(r["method"], r["budget"]) for r in rows] == [
        ("greedy", 1), ("best_of_n", 2), ("mcts", 2), ("best_of_n", 3), ("mcts", 3)]
    for r in rows:
        assert r["puzzles"] == 2 and r["calls"] <= 2 * r["budget"] and 0 <= r["solved"] <= 2
    assert rows[1]["calls"] == 4  # best-of-N spends its whole budget
