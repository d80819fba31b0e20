"""The CPU decode-step benchmark runs on the tiny model and reports both dtypes, their ratio and the
bandwidth view; it leaves the benchmark pages (docs/benchmarks/) alone without --docs."""

from __future__ import annotations

import json

import pytest

from agentrt.bench import decode_cpu as bench
from tests.benchpages import pages


def test_bench_decode_cpu_smoke(tiny_model_path, capsys):
    before = pages()
    argv = ["--model", str(tiny_model_path), "--contexts", "24,8", "--steps", "2", "--repeats", "3", "--json"]
    assert bench.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["dtypes"]) == {"float32", "bfloat16"} and res["read_gb_per_s"] > 0
    f32, b16 = res["dtypes"]["float32"], res["dtypes"]["bfloat16"]
    assert f32["weight_bytes"] == 2 * b16["weight_bytes"] > 0
    assert f32["kv_bytes_per_position"] == 2 * b16["kv_bytes_per_position"] > 0
    for e in (f32, b16):
        assert [r["context"] for r in e["rows"]] == [8, 24]
        assert all(0 < r["p10_ms"] <= r["median_ms"] and r["of_bandwidth"] > 0 for r in e["rows"])
    assert [r["context"] for r in res["ratio"]] == [8, 24] and all(r["p10"] > 0 for r in res["ratio"])
    assert "bf16 / fp32 per token" in bench.markdown(res)
    assert pages() == before


@pytest.mark.parametrize("argv", [["--contexts", "0"], ["--contexts", "a,b"], ["--repeats", "0"]])
def test_bench_decode_cpu_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
