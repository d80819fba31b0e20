"""The example programs on the real default model (slow): MCTS expands in parallel threads of one
program whose branches share KV blocks and returns the verifier's best; ReAct calls its tools and
answers."""

from __future__ import annotations

import pytest

import agentrt
from agentrt.programs.countdown import PUZZLES, verify
from agentrt.programs.mcts import Node, mcts
from agentrt.programs.react import WEATHER_LATENCY_S, react

pytestmark = [pytest.mark.slow, pytest.mark.anyio]


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
async def rt(default_model_path):
    async with agentrt.Runtime(str(default_model_path), num_blocks=512) as rt:
        yield rt


def nodes(root: Node):
    yield root
    for c in root.children:
        yield from nodes(c)


async def test_mcts_branches_are_threads_sharing_blocks_and_the_best_is_verified(rt):
    before = rt.kv_stats()
    r = await mcts(PUZZLES[6], budget=8, width=4, seed=0)
    after = rt.kv_stats()
    info = next(p for p in rt.programs if p.name == "mcts")
    assert info.state == "finished" and info.calls_done == r.calls <= 8
    assert info.num_threads >= 5  # 4 proposals of the first expansion, each its own thread, and the main one
    # every proposal continues the same prompt: concurrent duplicates merge, later calls hit the cache
    assert after.dedup_merges - before.dedup_merges > 0
    assert info.num_prefix_hit_tokens > 0 and after.prefix_hit_tokens - before.prefix_hit_tokens > 0
    evaluated = [n for n in nodes(r.root) if n.parent is not None]
    assert r.nodes == len(evaluated) + 1 and r.pruned + len(evaluated) <= r.proposals
    best = max(evaluated, key=lambda n: (n.solved, n.score))
    assert (r.solved, r.score) == (best.solved, best.score)
    assert r.solved == verify(r.puzzle, r.steps) and r.solved == best.solved


@pytest.mark.parametrize("question, tool, answer", [
    ("What is 17 * 23?", "calculator", "391"),
    ("How tall is Mount Everest?", "search", "8849"),
    ("What is the weather in Tokyo?", "weather", "22"),
])
async def test_react_calls_its_tools_and_answers(rt, question, tool, answer):
    r = await react(question, max_steps=4)
    assert 1 <= r.steps <= 4 and r.answer  # ended with an answer (or at its limit, forced)
    assert tool in [t for t, _, _ in r.tool_calls]
    assert answer in r.answer or r.forced
    info = next(p for p in reversed(list(rt.programs)) if p.name == "react")
    assert len(info.tool_durations[tool]) >= 1
    if tool == "weather":
        assert min(info.tool_durations["weather"]) >= WEATHER_LATENCY_S * 0.9  # real latency, measured
