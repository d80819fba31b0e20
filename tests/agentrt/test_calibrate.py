"""Step-cost calibration: the fit, the store keyed by machine, the fallback, --load."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from agentrt.bench import calibrate, costs
from agentrt.bench import simulate as sim
from agentrt.bench import workload as wl
from agentrt.bench.costs import StepCost, step_features
from agentrt.engine.request import Request
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.scheduler import SchedulerOutput

TRUE = StepCost(base_s=0.012, token_s=4e-4, decode_row_s=9e-4, context_s=2e-6, prefill_attn_s=1e-7, sample_s=1.5e-3,
                shared_context_s=8e-7)


def _synthetic(noise: float, seed: int = 0) -> list[tuple[str, tuple[int, ...], float]]:
    """Timings of the design's kind of steps, made by a known model with multiplicative noise."""
    rng = random.Random(seed)
    records = []
    for i in range(300):
        kind = i % 4
        if kind == 0:  # a prefill chunk, alone
            n, done = rng.choice([16, 64, 128, 256, 512]), rng.choice([0, 0, 256, 512])
            x = (1, n, 0, done + n, n * done + n * (n + 1) // 2, rng.random() < 0.5, 0)
        elif kind == 1:  # decode rows
            rows, ctx = rng.choice([1, 2, 4, 8, 16, 32]), rng.choice([32, 256, 1024])
            x = (1, rows, rows, rows * ctx, 0, rows, 0)
        elif kind == 2:  # decode rows + a chunk
            rows, n = rng.choice([2, 8]), rng.choice([64, 256])
            x = (1, rows + n, rows, rows * 130 + n, n * (n + 1) // 2, rows + 1, 0)
        else:  # decode rows over one prefix: the first reads it, the others share it
            rows, ctx = rng.choice([4, 8, 16]), rng.choice([256, 1024])
            x = (1, rows, rows, ctx + rows * 16, 0, rows, (rows - 1) * ctx)
        t = sum(c * v for c, v in zip(TRUE.coefficients(), x)) * (1 + rng.uniform(-noise, noise))
        records.append((f"s{i % 7}", tuple(int(v) for v in x), t))
    return records


def test_fit_recovers_known_coefficients():
    cost, err = calibrate.fit(_synthetic(noise=0.0))
    for got, want in zip(cost.coefficients(), TRUE.coefficients()):
        assert got == pytest.approx(want, rel=1e-6)
    assert err["max_rel"] < 1e-9 and err["scenario_max_rel"] < 1e-9


def test_fit_with_noise_stays_close_and_reports_its_error():
    cost, err = calibrate.fit(_synthetic(noise=0.05, seed=3))
    for name, got, want in zip(costs.FEATURES, cost.coefficients(), TRUE.coefficients()):
        assert got == pytest.approx(want, rel=0.25), name
    assert 0.005 < err["median_rel"] < 0.05 and err["max_rel"] < 0.12
    assert err["scenario_max_rel"] < 0.05


def test_nnls_keeps_coefficients_non_negative():
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    b = np.array([3.0, 2.0, 1.0])  # a falling line: the slope would be negative
    x = calibrate.nnls(a, b)
    assert x[1] == 0 and x[0] == pytest.approx(2.0)


def test_step_features_match_the_cost_model():
    prefill = Request("a", [1] * 100, SamplingParams())
    chunk = Request("c", [1] * 300, SamplingParams())
    chunk.num_computed_tokens = 100  # 100 more of 300: no sample yet
    decode = Request("b", [1] * 10, SamplingParams())
    decode.num_computed_tokens = 9
    out = SchedulerOutput([prefill, chunk, decode], [100, 100, 1], [])
    base, tokens, rows, context, attn, sampled, shared = step_features(out)
    assert (base, tokens, rows, sampled, shared) == (1, 201, 1, 2, 0)  # no block tables: nothing shared
    assert context == 100 + 200 + 10
    assert attn == 100 * 101 // 2 + (100 * 100 + 100 * 101 // 2)
    assert TRUE(out) == pytest.approx(sum(c * x for c, x in zip(TRUE.coefficients(), step_features(out))))


def test_rows_over_one_prefix_count_its_blocks_once_as_context_and_after_as_shared():
    rows = []  # three calls decoding the 41st token over 40 tokens in blocks of 16 (the third block partly)
    for i, table in enumerate(([0, 1, 2], [0, 1, 12], [0, 1, 2])):  # the second call's third block is its own
        r = Request(f"r{i}", [1] * 41, SamplingParams())
        r.num_computed_tokens, r.block_ids = 40, table
        rows.append(r)
    out = SchedulerOutput(rows, [1, 1, 1], [])
    *_, context, _, _, shared = step_features(out, block_size=16)
    # row 0 reads blocks 0-2 first (41 tokens); row 1 shares 0-1 (32) and reads its own 12 (9); row 2 shares all
    assert (context, shared) == (41 + 9, 32 + 41)
    assert context + shared == 3 * 41  # what every row attends over, as before the split
    cheaper = TRUE(out, 16)
    assert cheaper == pytest.approx(TRUE.base_s + 3 * TRUE.token_s + 3 * TRUE.decode_row_s + 50 * TRUE.context_s
                                    + 73 * TRUE.shared_context_s + 3 * TRUE.sample_s)
    # a fit made before the shared context had its own price prices it as context
    old = dataclasses.replace(TRUE, shared_context_s=None)
    assert old.coefficients()[-1] == TRUE.context_s and old(out, 16) > cheaper


def test_a_fit_without_shared_rows_leaves_the_shared_price_unknown():
    records = [r for r in _synthetic(noise=0.0) if r[1][-1] == 0]
    cost, _ = calibrate.fit(records)
    assert cost.shared_context_s is None and cost.coefficients()[-1] == cost.context_s


def test_stored_fit_is_found_again_by_its_key(tmp_path):
    fit = costs.Fit(key=costs.fit_key("m", "bfloat16", "avx512_bf16-2c-2t"), cost=TRUE, created="2026-12-01",
                    error={"median_rel": 0.03}, steps=400, cpu="test CPU")
    path = costs.store(fit, tmp_path)
    assert path.name == "m--bfloat16--avx512_bf16-2c-2t.json" and json.loads(path.read_text())["steps"] == 400
    assert costs.load(fit.key, tmp_path) == fit
    assert costs.load(costs.fit_key("m", "float32", "avx512_bf16-2c-2t"), tmp_path) is None  # other dtype
    assert costs.load(costs.fit_key("m", "bfloat16", "avx2-2c-2t"), tmp_path) is None  # other CPU kind


def test_this_machine_uses_its_fit_else_warns_and_falls_back(tmp_path, capsys):
    cost, line = costs.for_this_machine(directory=tmp_path)
    assert cost == costs.DEFAULT_CPU and "warning" in line and "--calibrate" in line
    assert "no calibrated step-cost fit for this machine" in capsys.readouterr().err
    key = costs.fit_key(*costs.default_model_and_dtype())
    costs.store(costs.Fit(key=key, cost=TRUE, created="today", error={"median_rel": 0.02}, steps=10), tmp_path)
    cost, line = costs.for_this_machine(directory=tmp_path)
    assert cost == TRUE and key in line and "warning" not in line
    assert capsys.readouterr().err == ""


def test_fit_key_names_the_engine_model_without_loading_it():
    from agentrt.engine.loader import resolve_model

    model, dtype = costs.default_model_and_dtype(dtype="float32")
    assert model == resolve_model(None).name and dtype == "float32"


def test_named_gpu_models_state_their_sources():
    for name, (cost, kv_tokens, source) in costs.NAMED.items():
        assert cost.base_s > 0 and source
        if name.startswith("h100"):
            assert kv_tokens and "spec sheet" in source
    with pytest.raises(SystemExit, match="unknown cost model 'tpu'"):
        costs.named("tpu")


def test_cost_arguments_are_checked():
    assert StepCost.parse("0.01,0.001,0,0") == StepCost(0.01, 0.001, 0, 0, 0, 0)
    assert StepCost.parse("1,2,3,4,5,6").sample_s == 6
    assert StepCost.parse("1,2,3,4,5,6,7").shared_context_s == 7
    for bad in ("1,2,3", "1,2,3,-4", "a,b,c,d", "1,2,3,4,5,6,7,8"):
        with pytest.raises(SystemExit, match="--cost must be"):
            StepCost.parse(bad)


def test_load_sets_the_rate_from_the_calibrated_capacity(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AGENTRT_CALIBRATION_DIR", str(tmp_path))
    key = costs.fit_key(*costs.default_model_and_dtype())
    costs.store(costs.Fit(key=key, cost=TRUE, created="today", error={"median_rel": 0.02}, steps=10))
    assert sim.main(["--programs", "6", "--policies", "fcfs,plas", "--load", "0.5", "--json", "--seed", "1"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    cap = sim.capacity(wl.make_workload(6, 1.0, 1), engine={"max_num_seqs": 4, "max_num_batched_tokens": 256},
                       cost=TRUE)
    assert report["config"]["capacity_programs_per_s"] == pytest.approx(cap)
    assert report["config"]["rate"] == pytest.approx(0.5 * cap) and report["config"]["load"] == 0.5
    assert key in captured.err
    with pytest.raises(SystemExit, match="--load must be"):
        sim.main(["--programs", "4", "--load", "-1"])


@pytest.mark.slow
def test_calibration_times_the_real_engine(tmp_path):
    """A cut-down design on the real default model: every scenario timed, a fit with sane coefficients."""
    from agentrt.engine.engine_core import EngineCore

    core = EngineCore(max_num_seqs=4, max_num_batched_tokens=128, num_blocks=256, device="cpu")
    scenarios = [calibrate.Scenario("prefill 100", ((100, 2, 0),)), calibrate.Scenario("decode 2 x 16", ((16, 6, 0),) * 2),
                 calibrate.Scenario("1 decoding + prefill 40", ((16, 8, 0), (40, 2, 2))),
                 calibrate.Scenario("decode 2 x 40 sharing 32", ((40, 4, 0),) * 2, 32)]
    records = calibrate.time_steps(core, scenarios, repeats=2)
    assert core.on_schedule is None and core.kv.num_free_blocks == core.kv.num_blocks
    assert {name for name, _, _ in records} == {s.name for s in scenarios}
    assert all(t > 0 for _, _, t in records)
    prefill = [x for name, x, _ in records if name == "prefill 100"]
    assert prefill[0][1] == 100 and prefill[0][2] == 0  # 100 tokens, no decode row
    # the second row reads the first one's two prefix blocks (the engine's own block tables): shared context
    assert max(x[-1] for name, x, _ in records if name.endswith("sharing 32")) >= 32
    assert all(x[-1] == 0 for name, x, _ in records if not name.endswith("sharing 32"))
    cost, err = calibrate.fit(records)
    assert cost(SchedulerOutput([Request("r", [1] * 8, SamplingParams())], [8], [])) > 0
    assert err["distinct_steps"] >= 4


def test_simcheck_reports_errors_ratios_and_targets():
    from agentrt.bench import simcheck

    rows = [{"load": 0.6, "rate": 0.9, "policy": p, "real_mean_s": real, "sim_mean_s": sim_, "real_p95_s": 2 * real,
             "sim_p95_s": 2 * sim_, "real_busy": 0.6, "sim_busy": 0.6,
             "mean_rel_err": sim_ / real - 1, "p95_rel_err": sim_ / real - 1}
            for p, real, sim_ in (("fcfs", 2.0, 2.2), ("plas", 1.0, 1.5))]
    report = {"rows": rows, "ratios": [{"load": 0.6, "policy": "plas", "real": 0.5, "sim": 1.5 / 2.2,
                                        "diff": 1.5 / 2.2 - 0.5}],
              "within_20pct": False, "ratios_within_0.1": False}
    text = simcheck.table(report)
    assert "| 0.60 | 0.900 | fcfs | 2.00 | 2.20 | +10% |" in text and "+50%" in text
    assert "within 20% of the real one: NOT met" in text and "+0.18" in text
    for bad in (["--loads", "x"], ["--loads", "0"], ["--programs", "0"], ["--policies", "lifo"]):
        with pytest.raises(SystemExit):
            simcheck.main(bad)
