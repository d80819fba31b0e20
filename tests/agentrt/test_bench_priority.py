"""The priority benchmark runs on the tiny model: every policy with the interactive program in class 0
and in class -1, the same batch work in each run; the benchmark pages (docs/benchmarks/) is left alone without --docs."""

from __future__ import annotations

import json

import pytest

from agentrt.bench import priority as bench
from tests.benchpages import pages


def test_bench_priority_smoke(tiny_model_path, capsys):
    before = pages()
    argv = ["--model", str(tiny_model_path), "--batch-programs", "4", "--batch-calls", "1", "--batch-tokens", "6",
            "--prompt-tokens", "16", "--turns", "2", "--turn-tokens", "2", "--think-s", "0", "--max-num-seqs", "2",
            "--json"]
    assert bench.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [(r["policy"], r["interactive_class"]) for r in rows] == [("fcfs", 0), ("fcfs", -1), ("plas", 0), ("plas", -1)]
    for r in rows:
        assert 0 < r["interactive_ttft_max_s"] <= r["interactive_latency_max_s"]
        assert 0 < r["interactive_latency_mean_s"] <= r["interactive_latency_max_s"]
        assert r["batch_tokens_per_s"] * r["makespan_s"] == pytest.approx(4 * 6)  # the same batch work every run
    assert "mean class 0 / this" in bench.table(rows)
    assert pages() == before


@pytest.mark.parametrize("argv", [["--turns", "0"], ["--batch-programs", "2", "--max-num-seqs", "4"],
                                  ["--policies", "nope"], ["--think-s", "-1"]])
def test_bench_priority_refuses_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert argv[1] in err or argv[3] in err, err  # the message names the bad value
