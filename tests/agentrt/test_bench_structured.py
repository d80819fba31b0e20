"""The structured-generation benchmark runs end to end on the tiny model and reports every number."""

from __future__ import annotations

import json

from agentrt.bench import structured as bench


def test_bench_structured_smoke(tiny_model_path, capsys):
    argv = ["--model", str(tiny_model_path), "--batch-sizes", "1,3", "--output-tokens", "6", "--repeats", "1",
            "--no-docs", "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["batches"]) == {"1", "3"}
    for row in report["batches"].values():
        assert row["steps"] == 5  # decode steps of one run: 6 tokens, the first from the prefill
        for key in ("free_step_ms", "con_step_ms", "mask_ms", "accept_ms"):
            assert row[key] > 0, key
    c = report["compile"]
    assert 0 < c["schema_cached_s"] < c["schema_cold_s"]
    assert all(c[k] > 0 for k in ("tokenizer_info_s", "regex_cold_s", "json_object_cold_s"))
    assert isinstance(report["target_met"], bool)
