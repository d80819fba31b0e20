"""The throughput benchmark runs end to end on the tiny model (a few requests) and reports every row."""

from __future__ import annotations

import json

from agentrt.bench import throughput as bench


def test_bench_throughput_smoke(tiny_model_path, capsys):
    argv = ["--model", str(tiny_model_path), "--num-requests", "3", "--hf-batch-sizes", "2,3",
            "--single-requests", "1", "--single-repeats", "2", "--speculative", "2", "--concurrent", "2", "--concurrent-tokens", "5", "--no-docs", "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    useful = sum(o for _, o in bench.workload(3, 0))
    assert report["output_tokens"] == useful
    assert set(report["hf_batched"]) == {"2", "3"}
    for key in ("engine_tok_s", "spec_tok_s", "hf_single_decode_tok_s", "engine_single_decode_tok_s",
                "spec_single_decode_tok_s", "ratio_vs_hf_batched", "ratio_single_decode"):
        assert report[key] > 0, key
    assert 0 <= report["spec_acceptance"] <= 1
    c = report["concurrency"]  # 2 calls of 5 tokens each, together and one at a time
    assert c["calls"] == 2 and c["output_tokens"] == 10 and c["concurrent_s"] > 0 and c["one_at_a_time_s"] > 0
    assert c["ratio"] == c["one_at_a_time_s"] / c["concurrent_s"] and "5 output tokens each" in c["output_lengths"]
    d = report["concurrency_decode"]  # the same with every prompt prefilled first
    assert d["calls"] == 2 and d["output_tokens"] == 10 and d["ratio"] == d["one_at_a_time_s"] / d["concurrent_s"]
