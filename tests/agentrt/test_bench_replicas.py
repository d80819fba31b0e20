"""bench replicas' plumbing without Ray: the pooled row over seeds and the report's ratios."""

import argparse

import pytest

from agentrt.bench import replicas


def run(router: str, seed: int, latencies: list[float], per_replica: list[int], cached: int, prompt: int) -> dict:
    return {"router": router, "replicas": 2, "seed": seed, "latencies": latencies, "wall_s": 10.0,
            "later_cached": cached, "later_prompt": prompt, "per_replica": per_replica, "programs_split": seed}


def test_pooled_rows_and_the_report():
    prog = replicas.pooled([run("program", 0, [2.0, 4.0], [5, 3], 80, 100), run("program", 1, [3.0], [4, 4], 90, 100)])
    assert prog["seeds"] == [0, 1] and prog["programs"] == 3 and prog["calls"] == 16
    assert prog["mean_s"] == pytest.approx(3.0) and prog["per_seed_mean_s"] == [3.0, 3.0]
    assert prog["later_hit_rate"] == pytest.approx(0.85) and prog["per_replica"] == [9, 7]
    assert prog["p95_s"] == 4.0 and prog["programs_split"] == 1
    pow2 = replicas.pooled([run("pow2", 0, [4.0, 6.0], [4, 4], 60, 100), run("pow2", 1, [5.0], [6, 2], 50, 100)])
    single = replicas.pooled([run("single", 0, [1.0], [8], 85, 100), run("single", 1, [1.0], [8], 85, 100)])
    text = replicas.report([single, prog, pow2], argparse.Namespace())
    assert "pow2 0.60x" in text and "Per seed, program vs pow2: 0.60x, 0.60x." in text
    assert "1.00x of one engine's" in text  # 85% later-turn hits, as one engine's
