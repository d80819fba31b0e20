"""Tree search (MCTS-style): expand a node into parallel branches, score them, go deeper on the best.

Branches run as parallel threads of one program (`agentrt.gather`), so ATLAS schedules them
together; every branch shares the parent's prefix, which the engine computes once.
"""

from __future__ import annotations

import math

import agentrt


@agentrt.tool
async def score(text: str) -> float:
    """A stand-in value function: prefers longer, varied continuations."""
    words = text.split()
    return len(set(words)) / (1 + math.log1p(len(words))) if words else 0.0


@agentrt.program(name="tree_search")
async def tree_search(task: str, width: int = 3, depth: int = 2, max_tokens: int = 24) -> str:
    best = f"Task: {task}\nPlan:"
    for _ in range(depth):
        branches = await agentrt.gather(
            *(agentrt.generate(best, max_tokens=max_tokens, temperature=0.9, seed=i) for i in range(width))
        )
        scores = [await score(b) for b in branches]
        best += branches[max(range(width), key=scores.__getitem__)]
    return best
