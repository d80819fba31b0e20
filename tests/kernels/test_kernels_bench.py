"""agentrt/bench/kernels.py: the no-GPU exit, and its measuring code run on CPU with a tiny shape and a fake clock."""

import json

import pytest
import torch

from agentrt.bench import kernels as bench


def test_without_cuda_it_skips_cleanly(capsys):
    if torch.cuda.is_available():
        return
    assert bench.main([]) == 0
    assert capsys.readouterr().out.strip() == bench.SKIP_MESSAGE
    assert bench.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"skipped": bench.SKIP_MESSAGE}


def test_measuring_code_runs_on_a_tiny_shape(monkeypatch):
    monkeypatch.setattr(bench, "_time_ms", lambda fn: (fn(), 0.5)[1])
    monkeypatch.setattr(bench, "_fits", lambda num_bytes: num_bytes < 10_000_000)
    shape = bench.Shape(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    cpu = torch.device("cpu")
    decode, paging = bench._decode(shape, 100.0, cpu, [1, 2], [40, 100_000], [2], [40])
    assert [("skipped" in r) for r in decode] == [False, False, True, True]
    assert decode[0]["kv_bytes"] == 2 * 1 * 40 * 2 * 64 * 4
    assert len(paging) == 1 and paging[0]["paging_overhead_pct"] == 0.0
    prefill = bench._prefill(shape, cpu, [(20, 0), (8, 30)])
    assert "ratio_to_sdpa" in prefill[0] and "ratio_to_sdpa" not in prefill[1]
    text = bench._markdown({"device": "cpu", "torch": "-", "triton": "-", "shape": "tiny", "copy": {"gb_per_s": 100.0},
                            "decode": decode, "paging": paging, "prefill": prefill})
    assert text.count("\n| ") >= 8 and "does not fit" in text and "### Decode" not in text


def test_sweep_times_each_tile_shape(monkeypatch):
    monkeypatch.setattr(bench, "_time_ms", lambda fn: (fn(), 0.25)[1])
    monkeypatch.setattr(bench, "_fits", lambda num_bytes: num_bytes < 10_000_000)
    monkeypatch.setattr(bench, "DECODE_SWEEP", [(64, 4, 2), (32, 2, 3)])
    monkeypatch.setattr(bench, "DECODE_SWEEP_CASES", [(2, 40)])
    monkeypatch.setattr(bench, "SPLIT_SWEEP", [2])
    monkeypatch.setattr(bench, "PREFILL_SWEEP", [(64, 64, 4, 2), (16, 32, 4, 3), (8, 32, 4, 2)])  # 8: rejected
    monkeypatch.setattr(bench, "PREFILL_SWEEP_CASES", [(20, 5)])
    shape = bench.Shape(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    sweep = bench._sweep(shape, 100.0, torch.device("cpu"))
    assert [(r.get("block_n"), r["splits"]) for r in sweep["decode"]] == [(64, "auto"), (32, "auto"), (None, 2)]
    assert all(r["time_ms"] == 0.25 for r in sweep["decode"])
    assert [r["block_m"] for r in sweep["prefill"]] == [64, 16, 8]
    assert "error" in sweep["prefill"][2] and "tflop_per_s" in sweep["prefill"][1]
    text = "\n".join(bench._sweep_markdown(sweep, "###"))
    assert text.count("| 2 | 40 |") == 3 and "error" in text


def test_launch_config_rejects_unknown_settings():
    from agentrt.kernels.paged_attention import launch_config

    with pytest.raises(ValueError, match="block_k"), launch_config(block_k=32):
        pass
