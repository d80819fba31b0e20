"""bench replicas' plumbing without Ray: the pooled row over seeds and the report's ratios."""

import argparse

import pytest

from agentrt.bench import replicas


def run(router: str, seed: int, latencies: list[float], per_replica: list[int], cached: int, prompt: int) -> dict:
    return {"router": router, "replicas": 2, "seed": seed, "latencies": latencies, "wall_s": 10.0,
            "later_cached": cached, "later_prompt": prompt, "per_replica": per_replica, "programs_split": seed,
            "calls_running": [1.5, 0.5], "skew": 1.0 + seed, "later_calls": 4, "later_same": 4 - 2 * seed}


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
    assert prog["calls_running"] == [1.5, 0.5] and prog["skew"] == 1.5
    assert "| 1.5 / 0.5 | 1.50 |" in text
    assert prog["same_replica"] == pytest.approx(0.75) and "| 75% |" in text


def test_later_calls_on_the_previous_calls_replica():
    calls = [{"program": "p", "turn": t, "replica": r} for t, r in enumerate("aabab")]
    calls += [{"program": "q", "turn": t, "replica": "b"} for t in (2, 0, 1)]  # order of arrival does not matter
    assert replicas._same_replica(calls) == 1 + 2  # p: a->a once; q: b->b twice


def test_calls_running_per_replica_and_the_skew():
    """Two replicas over 4 s of calls: a runs one call over 0-4 s and another over 1-3 s; b one over 2-4 s."""
    calls = [{"replica": "a", "start": 0.0, "end": 4.0}, {"replica": "a", "start": 1.0, "end": 3.0},
             {"replica": "b", "start": 2.0, "end": 4.0}]
    busy = replicas._busy(calls, 2)
    assert busy["a"] == pytest.approx(6 / 4) and busy["b"] == pytest.approx(2 / 4)
    # |a - b|: 1 over 0-1, 2 over 1-2, 1 over 2-3, 0 over 3-4
    assert busy["skew"] == pytest.approx(4 / 4)
    idle = replicas._busy(calls[:2], 2)  # b sent nothing: it counts, idle
    assert idle["(idle 0)"] == 0.0 and idle["skew"] == pytest.approx(6 / 4)
    assert replicas._busy([], 2) == {"skew": 0.0}
