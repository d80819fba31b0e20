"""The serving benchmark runs end to end (tiny model, a server subprocess, a few requests) and reports
every peer and rate with no failed request."""

from __future__ import annotations

import json

from agentrt.bench import serve as bench


def test_bench_serve_smoke(tiny_model_path, capsys):
    argv = ["--model", str(tiny_model_path), "--rates", "4", "--duration-s", "1", "--max-requests", "3",
            "--saturation-requests", "3", "--repeats", "1", "--ttft-requests", "2", "--ttft-max-tokens", "4",
            "--output-min", "4", "--output-max", "8", "--prompt-max", "64", "--kv-cache-gb", "0.05",
            "--no-docs", "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    sat, ttft = report["peers"]["saturation"], report["peers"]["ttft"]
    assert len(sat["repeats"]) == 1 and sat["repeats"][0]["failed"] == 0
    assert sat["repeats"][0]["prompt_len_mismatches"] == 0
    assert sat["server_tok_s"] > 0 and sat["llm_tok_s"] > 0 and sat["ratio"] > 0
    assert ttft["requests"] == 2 and len(ttft["pairs_ms"]) == 2 and ttft["server_p50_ms"] > 0
    (rate,) = report["rates"]
    assert rate["rate"] == 4 and 1 <= rate["requests"] <= 3
    assert rate["failed"] == 0 and rate["completed"] == rate["requests"] and not rate["errors"]
    assert rate["output_tok_s"] > 0 and rate["e2e_s"]["p50"] > 0
    assert set(rate["ttft_ms"]) == set(rate["itl_ms"]) == {"p50", "p99"}
    assert set(report["targets"]) == {"no_failures_at_sustainable_rates", "saturated_ratio_ge_0.90",
                                      "low_load_ttft_within_10ms"}


def test_workload_is_seeded(tiny_model_path):
    from agentrt.engine.loader import load_tokenizer

    tok = load_tokenizer(tiny_model_path)
    a = bench.Prompts(tok, (32, 256), (16, 64), seed=3).draw("x", 8)
    b = bench.Prompts(tok, (32, 256), (16, 64), seed=3).draw("x", 8)
    assert a == b and a != bench.Prompts(tok, (32, 256), (16, 64), seed=3).draw("y", 8)
    assert all(r.prompt_ids == bench.chat_ids(tok, r.content) for r in a)
    assert all(20 <= len(r.prompt_ids) <= 256 and 16 <= r.max_tokens <= 64 for r in a)
    arrivals = bench.poisson_arrivals(2.0, 10.0, 100, seed=0)
    assert arrivals == sorted(arrivals) and arrivals[-1] <= 10.0 and arrivals == bench.poisson_arrivals(2.0, 10.0, 100, 0)
