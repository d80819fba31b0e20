"""The LoRA benchmark runs on the tiny model: every workload (base, one adapter, adapters mixed; batched
and one at a time) measured against the base of its mode, and the benchmark pages (docs/benchmarks/) left alone without
--docs."""

from __future__ import annotations

import json

import pytest

from agentrt.bench import lora as bench
from tests.benchpages import pages


def test_bench_lora_smoke(tiny_model_path, capsys):
    before = pages()
    argv = ["--model", str(tiny_model_path), "--batch", "3", "--single", "1", "--adapters", "2", "--rank", "4",
            "--prompt-len", "20", "--max-tokens", "4", "--repeats", "1", "--json"]
    assert bench.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    rows = [(w["mode"], w["requests"], w["name"]) for w in res["workloads"]]
    assert rows == [("batched", 3, "base"), ("batched", 3, "1 adapter"), ("batched", 3, "2 adapters"),
                    ("one at a time", 1, "base"), ("one at a time", 1, "1 adapter")]
    for w in res["workloads"]:
        assert w["tok_s"] > 0 and w["ratio"] > 0
    assert [w["ratio"] for w in res["workloads"] if w["name"] == "base"] == [1.0, 1.0]
    assert "vs base" in bench.markdown(res)
    assert pages() == before


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--rank", "0"], ["--repeats", "0"]])
def test_bench_lora_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
