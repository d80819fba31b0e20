"""The embeddings benchmark runs on the tiny model, compares the engine with HF on both workloads (the
vectors agree, the shared prefix hits the cache) and leaves the benchmark pages (docs/benchmarks/) alone without --docs."""

from __future__ import annotations

import json

import pytest

from agentrt.bench import embed as bench
from tests.benchpages import pages


def test_bench_embed_smoke(tiny_model_path, capsys):
    before = pages()
    argv = ["--model", str(tiny_model_path), "--num-inputs", "6", "--min-len", "4", "--max-len", "20",
            "--shared-prefix", "32", "--hf-batch-size", "4", "--repeats", "2", "--json",
            "--max-num-batched-tokens", "48"]
    assert bench.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    distinct, shared = res["workloads"]
    assert (distinct["name"], shared["name"]) == ("distinct", "shared prefix")
    assert shared["input_tokens"] == distinct["input_tokens"] + 6 * 32
    for w in (distinct, shared):
        assert w["engine_tok_s"] > 0 and w["hf_tok_s"] > 0 and w["ratio"] > 0
        assert w["min_cosine"] > 0.9999  # the same vectors, up to rounding
    assert distinct["prefix_hit_tokens_per_pass"] == 0  # new token ids every pass
    assert shared["prefix_hit_tokens_per_pass"] > 0  # the instruction is computed once a pass
    assert "engine / HF" in bench.markdown(res)
    assert pages() == before


@pytest.mark.parametrize("argv", [["--num-inputs", "0"], ["--min-len", "9", "--max-len", "3"],
                                  ["--shared-prefix", "-1"]])
def test_bench_embed_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
