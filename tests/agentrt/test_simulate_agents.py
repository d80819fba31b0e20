"""The full-size agents simulator (agentrt/bench/simulate.py agents, agentrt/bench/sim_engine.py): the four configs and
the exactness of the decode-run fast path."""

from __future__ import annotations

import pytest

from agentrt._retention import RetentionConfig
from agentrt.bench import costs
from agentrt.bench import simulate as sim
from agentrt.bench import workload as wl


def _agents(n: int, rate: float, configs, num_blocks: int):
    """`n` full-size agents on a cache of `num_blocks` 256-token blocks (small: memory pressure)."""
    cost, _, _ = costs.named("h100-llama-3.1-8b")
    engine = {"max_num_seqs": 64, "max_num_batched_tokens": 8192, "num_blocks": num_blocks, "block_size": 256}
    work = wl.make_agent_workload(n, rate, seed=4)
    out = {}
    for name in configs:
        policy, kwargs, ttl = sim.AGENT_CONFIGS[name]
        out[name] = sim.simulate(policy, work, policy_kwargs=kwargs, engine=engine, cost=cost,
                                 retention=RetentionConfig(ttl=ttl))
    return out


def test_agent_configs_run_the_same_programs_and_the_composition_keeps_pins():
    res = _agents(12, 0.2, sim.DEFAULT_AGENT_CONFIGS + ("fcfs+ttl+guard",), num_blocks=500)
    kinds = [[p["kind"] for p in r["programs"]] for r in res.values()]
    assert all(k == kinds[0] for k in kinds)
    calls = [[p["calls"] for p in r["programs"]] for r in res.values()]
    assert all(c == calls[0] for c in calls)  # the same plans, whatever the order
    assert res["fcfs"]["ttl_hits"] == res["plas"]["ttl_hits"] == 0
    assert res["plas+ttl"]["ttl_hits"] > 0 and res["fcfs+ttl"]["ttl_hits"] > 0
    # under pressure, PLAS + TTL recomputes less than PLAS and preempts less (no displacement)
    assert res["plas+ttl"]["recomputed_prefill_tokens"] < res["plas"]["recomputed_prefill_tokens"]
    assert res["plas+ttl"]["preemptions"] < res["plas"]["preemptions"]
    assert _agents(12, 0.2, ["plas+ttl"], num_blocks=500)["plas+ttl"] == res["plas+ttl"]  # deterministic


def test_rate_at_latency_interpolates_each_config():
    rows = [{"config": "a", "rate": r, "latency_mean_s": lat} for r, lat in ((0.1, 50.0), (0.2, 100.0), (0.3, 300.0))]
    assert sim.rate_at_latency(rows, "a", 200.0) == pytest.approx(0.25)
    assert sim.rate_at_latency(rows, "a", 40.0) is None and sim.rate_at_latency(rows, "a", 400.0) is None


@pytest.mark.parametrize("config", ["fcfs", "fcfs+ttl", "plas", "plas+ttl"])
def test_decode_runs_give_exactly_the_single_step_results(config):
    """agentrt/bench/sim_engine.py's fast path for plain decode steps changes nothing but the wall time."""
    cost, _, _ = costs.named("h100-llama-3.1-8b")
    policy, kwargs, ttl = sim.AGENT_CONFIGS[config]
    work = wl.make_agent_workload(10, 0.3, seed=5)
    res = {}
    for fast in (True, False):
        engine = {"max_num_seqs": 64, "max_num_batched_tokens": 8192, "num_blocks": 400, "block_size": 256, "fast": fast}
        res[fast] = sim.simulate(policy, work, policy_kwargs=kwargs, engine=engine, cost=cost,
                                 retention=RetentionConfig(ttl=ttl))
    assert res[True] == res[False]
    assert res[True]["preemptions"] + res[True]["ttl_hits"] > 0  # pressure and pins were exercised


def test_decode_runs_cover_most_steps_of_a_light_load():
    from agentrt.bench.sim_engine import SimEngine

    seen = {}
    real_init = SimEngine.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        seen["eng"] = self

    SimEngine.__init__ = init
    try:
        sim.simulate("fcfs", wl.make_agent_workload(4, 0.05, seed=1),
                     engine={"max_num_seqs": 64, "max_num_batched_tokens": 8192, "num_blocks": 1000, "block_size": 256},
                     cost=costs.named("h100-llama-3.1-8b")[0])
    finally:
        SimEngine.__init__ = real_init
    eng = seen["eng"]
    assert eng.num_fast_steps > 0.8 * eng.num_steps
