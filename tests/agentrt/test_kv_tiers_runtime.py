"""The KV tiers seen from above the engine: a program's record counts the tokens the tiers loaded for it, the
retention TTL weighs the tiers' reload cost, `bench tiers` on the tiny model, and the simulator's tiers."""

from __future__ import annotations

import anyio
import pytest

import agentrt
from agentrt._retention import RetentionConfig, RetentionPolicy
from agentrt.bench import costs
from agentrt.bench import simulate as sim
from agentrt.bench import sim_tiers
from agentrt.bench import tiers as bench_tiers
from agentrt.bench import workload as wl
from agentrt.engine import SamplingParams


def test_program_record_counts_tokens_loaded_from_the_host_tier(tiny_model_path):
    prompt = list(range(3, 3 + 70))  # 4 full blocks and a few tokens

    async def go():
        # 6 blocks: a call takes 5 (4 full, 1 partial); the second call's 5 evict the first's last 3 full blocks
        async with agentrt.Runtime(str(tiny_model_path), retention=RetentionConfig(ttl=False), num_blocks=6,
                                   kv_host_gib=0.01) as rt:
            info = rt.start_program(name="p")
            pid = info.program_id
            p = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            for prompt_ in (prompt, [t + 200 for t in prompt], prompt):  # the middle one evicts the first
                call = rt.submit(prompt_, p, program_id=pid)
                async with call:
                    await call.result()
            kv = rt.program_kv(pid)
            stats = rt.kv_stats()
            rt.end_program(pid)
            return kv, stats

    kv, stats = anyio.run(go)
    assert stats.tiers["host"].hits == 3  # the first prompt's blocks 1-3 came back from T1 (block 0 stayed in T0)
    assert kv.tier_loaded_tokens == 3 * 16
    assert stats.prefix_hit_tokens == 4 * 16


def test_retention_ttl_weighs_the_cheaper_reload():
    sent = []
    durations = [0.5] * 30
    slow = RetentionPolicy(RetentionConfig(), sent.append, 10_000)
    fast = RetentionPolicy(RetentionConfig(), sent.append, 10_000, reload_s_per_token=1e-6)
    for pol in (slow, fast):
        pol.s_per_token = 1e-3
        for d in durations:
            pol.record_duration("search", d)
    # recomputing 1,000 tokens costs 1 s > the 0.5 s wait: pin; reloading costs 1 ms < 0.5 s: do not
    assert slow.ttl_for("search", 1000) == 0.5
    assert fast.ttl_for("search", 1000) == 0.0


def test_bench_tiers_on_the_tiny_model_saves_recompute(tiny_model_path):
    specs = bench_tiers.workload(3, 4.0, seed=1)
    size = {**bench_tiers.SIZE, "task": 120, "observation": (16, 32), "tool_median_s": 0.2, "turns": (3, 3)}
    rows = {}
    for config, options in (("t0", {}), ("t1", {"kv_host_gib": 0.01})):
        rows[config] = anyio.run(bench_tiers.run_one, config, specs, str(tiny_model_path), 24, 0.02, options, size)
    t0, t1 = rows["t0"], rows["t1"]
    assert t0["programs"] == t1["programs"] == 3
    assert t0["tiers"] == {} and t1["tiers"]["host"]["hit_tokens"] > 0
    assert t1["recomputed_prefill_tokens"] < t0["recomputed_prefill_tokens"]
    assert t1["prefix_hit_rate"] > t0["prefix_hit_rate"]
    assert "t1" in bench_tiers.table([t0, t1])


def test_simulated_tiers_load_instead_of_recompute_and_free_every_block():
    cost, _, _ = costs.named("h100-llama-3.1-8b")
    engine = {"max_num_seqs": 64, "max_num_batched_tokens": 8192, "num_blocks": 400, "block_size": 256}
    work = wl.make_agent_workload(10, 0.2, seed=3)
    policy, kwargs, _ = sim.AGENT_CONFIGS["plas+ttl+tiers"]
    base = sim.simulate(policy, work, policy_kwargs=kwargs, engine=engine, cost=cost, retention=RetentionConfig())
    tiered = sim.simulate(policy, work, policy_kwargs=kwargs, engine=engine, cost=cost, retention=RetentionConfig(),
                          tiers=sim_tiers.H100_TIERS)  # simulate() asserts every T0 block free at the end
    assert base["tier_hits"] == {} and tiered["tier_hits"]["host"] > 0
    assert tiered["recomputed_prefill_tokens"] < base["recomputed_prefill_tokens"]
    assert tiered["pinned_block_s"] < base["pinned_block_s"]  # a cheap reload shortens the TTL
    assert [p["calls"] for p in tiered["programs"]] == [p["calls"] for p in base["programs"]]


def test_sim_tier_cost_is_bytes_over_bandwidth():
    c = sim_tiers.H100_TIERS
    assert c.load_s_per_block(1, 256) == pytest.approx(131072 * 256 / 50e9)
    assert c.load_s_per_block(2, 256) == pytest.approx(131072 * 256 / 6e9)


def test_bench_tiers_pools_seeds_by_what_each_figure_is_a_rate_of():
    run = {"config": "t1", "options": {}, "makespan_s": 10.0, "recompute_s_per_token": 4e-4, "queries": 100,
           "latencies": [1.0, 2.0], "recomputed_prefill_tokens": 5, "prefix_hit_rate": 0.5, "ttl_hits": 1,
           "ttl_misses": 2, "preemptions": 0, "programs": 2, "loaded_calls_ttft_s": [0.3, 0.1], "loaded_tokens": 64,
           "tiers": {"host": {"hit_tokens": 10, "load_s": 1e-3, "demotions": 3, "evictions": 0, "skipped": 0,
                              "corrupt": 0, "in_place_tokens": 4, "t0_blocks_for_loads": 2}}}
    other = {**run, "makespan_s": 20.0, "queries": 300, "latencies": [3.0, 10.0], "prefix_hit_rate": 1.0,
             "loaded_calls_ttft_s": [0.2], "loaded_tokens": 16,
             "tiers": {"host": {**run["tiers"]["host"], "hit_tokens": 30, "load_s": 5e-3}}}
    p = bench_tiers.pooled([run, other])
    assert p["latency_mean_s"] == 4.0 and p["latency_p95_s"] == 10.0 and p["programs"] == 4
    assert p["prefix_hit_rate"] == (50 + 300) / 400 and p["makespan_s"] == 15.0
    assert p["tiers"]["host"]["hit_rate"] == 40 / 400 and p["tiers"]["host"]["load_s_per_token"] == 6e-3 / 40
    assert p["tiers"]["host"]["demotions"] == 6 and p["recomputed_prefill_tokens"] == 10
    # in-place reads (t1 against t1-copy): the calls that loaded from a tier pooled, counts summed
    assert p["loaded_calls_ttft_s"] == [0.1, 0.2, 0.3] and p["loaded_tokens"] == 80
    assert (p["tiers"]["host"]["in_place_tokens"], p["tiers"]["host"]["t0_blocks_for_loads"]) == (8, 4)
    assert bench_tiers.loads_table([p]).splitlines()[2] == "| t1 | 3 | 200 | 200 | 80 | 20% | 4 |"


def test_an_engine_going_idle_writes_its_last_blocks_through_to_disk(tiny_model_path, tmp_path):
    """The blocks the last step completed reach the disk tier when the engine goes idle, not at a next step that
    may never come (another server sharing the directory looks for them)."""
    from agentrt.engine.llm import LLM

    llm = LLM(str(tiny_model_path), num_blocks=16, kv_disk_dir=str(tmp_path))
    try:
        # 40 prompt tokens + 9 output tokens, the last never computed: 48 computed, 3 full blocks, the third
        # completed by the last decode step
        llm.generate([list(range(3, 43))], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
                     progress=False)
        llm.core.tiers.disk.flush()
        assert len(llm.core.tiers.disk) == 3
    finally:
        llm.close()
