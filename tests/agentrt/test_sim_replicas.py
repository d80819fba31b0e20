"""Replicas in the simulator (agentrt/bench/sim_replicas.py): every router runs the same programs to the end with
every block back, the program router keeps programs on one replica and reuses more of their prefixes
than round-robin, and the runs are deterministic."""

from __future__ import annotations

import pytest

from agentrt.bench import costs
from agentrt.bench import workload as wl
from agentrt.bench.sim_replicas import SIM_ROUTERS, simulate_replicas


def _run(router: str, replicas: int = 3, n: int = 9, rate: float = 0.6):
    cost, _, _ = costs.named("h100-llama-3.1-8b")
    engine = {"max_num_seqs": 64, "max_num_batched_tokens": 8192, "num_blocks": 4000, "block_size": 256}
    return simulate_replicas(wl.make_agent_workload(n, rate, seed=3), replicas=replicas, router=router,
                             engine=engine, cost=cost, seed=1)


@pytest.fixture(scope="module")
def runs():
    return {r: _run(r) for r in SIM_ROUTERS}


def test_every_router_runs_every_program(runs):
    calls = {r: sorted((p["kind"], p["calls"]) for p in res["programs"]) for r, res in runs.items()}
    assert all(c == calls["program"] for c in calls.values())  # the same plans, whatever the routing
    for res in runs.values():
        assert sum(res["calls_per_replica"]) == sum(p["calls"] for p in res["programs"])
    assert min(runs["round-robin"]["calls_per_replica"]) > 0  # round-robin spreads calls over every replica


def test_the_program_router_keeps_prefixes_that_round_robin_loses(runs):
    assert runs["program"]["prefix_hit_rate"] > runs["round-robin"]["prefix_hit_rate"] + 0.1
    assert runs["program"]["computed_tokens"] < runs["round-robin"]["computed_tokens"]


def test_deterministic_and_refuses_unknown_routers(runs):
    assert _run("program") == runs["program"]
    with pytest.raises(ValueError, match="unknown router 'nope'"):
        _run("nope")
