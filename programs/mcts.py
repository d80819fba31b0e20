"""Monte-Carlo tree search with the LLM as its proposal policy, on Countdown (`countdown.py`).

A node is a partial solution (the steps so far); the root is the bare puzzle. Each iteration:

1. **select** — from the root, follow the child with the best UCT score,
   `Q / n + c * sqrt(ln N / n)`, to a node not expanded yet, or one whose children are all done
   (it is expanded again, up to `max_expansions` times, then retired);
2. **expand** — ask the model for `width` next steps in parallel: `agentrt.gather` runs them as
   threads of this one program, all continuing the same prompt (few-shot, puzzle, path), so the
   engine computes that prefix once and the branches share its KV blocks. Branch i continues it
   from the i-th available number (the model writes the operator and the other operand): a
   135M model sampled alone repeats its favourite first step;
3. **evaluate** — the verifier checks every proposal (operands available, exact arithmetic) and
   recomputes its result; a malformed proposal prunes its branch. A child is scored 1 when it
   reaches the target, else by how near its numbers are to the target (`closeness`), optionally
   mixed with the model's own yes/no estimate (`value_weight`);
4. **backpropagate** — add the score to every node on the path.

It stops at a verified solution, when the call budget is spent, or when no branch is left.
The result is the best node the verifier saw, with its verification.

    agentrt run programs/mcts.py -- --numbers 4 7 12 --target 41 --budget 16
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import agentrt
from agentrt.programs.countdown import PUZZLES, Puzzle, Step, closeness, parse_step, prompt, render, verify


@dataclass(eq=False)
class Node:
    steps: tuple[Step, ...]
    left: tuple[int, ...]  # numbers available here
    parent: Node | None = None
    children: list[Node] = field(default_factory=list)
    visits: int = 0
    value_sum: float = 0.0
    score: float = 0.0  # the verifier's (and model's) evaluation of this node
    solved: bool = False
    expansions: int = 0  # times proposals were asked for here
    exhausted: bool = False  # nothing left to explore below

    @property
    def terminal(self) -> bool:
        return self.solved or len(self.left) < 2

    def uct(self, c: float) -> float:
        if self.visits == 0:
            return math.inf
        assert self.parent is not None
        return self.value_sum / self.visits + c * math.sqrt(math.log(self.parent.visits) / self.visits)


@dataclass
class MCTSResult:
    puzzle: Puzzle
    solved: bool  # the verifier accepted `steps`
    steps: list[Step]  # the best path found
    score: float
    calls: int  # LLM calls made
    expansions: int
    proposals: int  # proposals received
    pruned: int  # malformed proposals (their branches pruned)
    nodes: int
    root: Node  # the search tree

    @property
    def text(self) -> str:
        return render(self.steps)


def select(root: Node, c: float, max_expansions: int) -> Node | None:
    """The node UCT leads to that is to be expanded, or None when the whole tree is exhausted. A node
    whose children are all exhausted is expanded again (new proposals), up to `max_expansions` times."""
    node = root
    while node.expansions:
        live = [ch for ch in node.children if not ch.exhausted]
        if live:
            node = max(live, key=lambda ch: ch.uct(c))
        elif node.expansions < max_expansions:
            return node
        else:
            node.exhausted = True
            if node.parent is None:
                return None
            node = root  # re-descend; the exhausted node is now skipped
    return node


def backpropagate(node: Node | None, value: float) -> None:
    while node is not None:
        node.visits += 1
        node.value_sum += value
        node = node.parent


def children_from(node: Node, proposals: Sequence[str], target: int) -> tuple[list[Node], int]:
    """New children for the distinct valid proposals, and the number of malformed ones."""
    seen = {(s.a, s.op, s.b) for s in (ch.steps[-1] for ch in node.children)}
    children, pruned = [], 0
    for text in proposals:
        step = parse_step(text, node.left)
        if step is None:
            pruned += 1
            continue
        key = (min(step.a, step.b), step.op, max(step.a, step.b)) if step.op in "+*" else (step.a, step.op, step.b)
        if key in seen:
            continue
        seen.add(key)
        child = Node((*node.steps, step), step.left, parent=node)
        child.solved = step.result == target
        child.score = 1.0 if child.solved else closeness(step.left, target)
        child.exhausted = child.terminal
        children.append(child)
    return children, pruned


async def _llm_value(puzzle: Puzzle, node: Node, max_tokens: int) -> float:
    question = (f"{prompt(puzzle, node.steps)}Can {' '.join(map(str, node.left))} still make {puzzle.target}? "
                "Answer yes or no:")
    reply = await agentrt.generate(question, max_tokens=max_tokens, temperature=0)
    return 1.0 if reply.strip().lower().startswith("yes") else 0.0


@agentrt.program(name="mcts")
async def mcts(
    puzzle: Puzzle,
    budget: int = 16,
    width: int = 4,
    c: float = 1.0,
    temperature: float = 0.7,
    max_tokens: int = 16,
    value_weight: float = 0.0,
    max_expansions: int = 2,
    seed: int = 0,
) -> MCTSResult:
    """Search for a solution of `puzzle` with at most `budget` LLM calls, `width` proposals per
    expansion (see the module docstring)."""
    if budget < 1 or width < 1:
        raise ValueError(f"budget and width must be >= 1, got budget={budget}, width={width}")
    root = Node((), puzzle.numbers)
    root.score = closeness(puzzle.numbers, puzzle.target)
    best, calls, expansions, proposals, pruned, nodes = root, 0, 0, 0, 0, 1
    while calls < budget and not best.solved:
        node = select(root, c, max_expansions)
        if node is None:
            break
        k = min(width, budget - calls)
        text = prompt(puzzle, node.steps)
        starts = [str(node.left[(i + node.expansions) % len(node.left)]) for i in range(k)]
        replies = await agentrt.gather(*(
            agentrt.generate(text + start, max_tokens=max_tokens, temperature=temperature,
                             seed=seed * 100_003 + calls + i, stop=["\n"])
            for i, start in enumerate(starts)
        ))
        replies = [start + reply for start, reply in zip(starts, replies)]
        calls += k
        expansions += 1
        proposals += k
        node.expansions += 1
        children, bad = children_from(node, replies, puzzle.target)
        pruned += bad
        node.children += children
        nodes += len(children)
        if value_weight > 0:
            open_children = [ch for ch in children if not ch.terminal][: max(0, budget - calls)]
            estimates = await agentrt.gather(*(_llm_value(puzzle, ch, 2) for ch in open_children))
            calls += len(open_children)
            for ch, v in zip(open_children, estimates):
                ch.score = (1 - value_weight) * ch.score + value_weight * v
        if not children:  # every proposal malformed or already a child; `select` retires the node
            backpropagate(node, 0.0)
            continue
        for ch in children:
            backpropagate(ch, ch.score)
            if (ch.solved, ch.score) > (best.solved, best.score):
                best = ch
    steps = list(best.steps)
    return MCTSResult(puzzle, verify(puzzle, steps), steps, best.score, calls, expansions, proposals, pruned, nodes,
                      root)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="mcts.py", description="MCTS on a Countdown puzzle")
    ap.add_argument("--numbers", type=int, nargs="+", default=list(PUZZLES[2].numbers))
    ap.add_argument("--target", type=int, default=PUZZLES[2].target)
    ap.add_argument("--budget", type=int, default=16, help="LLM calls at most")
    ap.add_argument("--width", type=int, default=4, help="parallel proposals per expansion")
    ap.add_argument("--value-weight", type=float, default=0.0, help="weight of the model's own value estimate")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


async def main(argv: Sequence[str] = ()) -> int:
    """`agentrt run programs/mcts.py [--url URL] -- ARGS`: the CLI provides the runtime."""
    a = parse_args(argv)
    r = await mcts(Puzzle(tuple(a.numbers), a.target), budget=a.budget, width=a.width, value_weight=a.value_weight,
                   seed=a.seed)
    print(r.puzzle)
    print(r.text or "(no valid step found)")
    print(f"{'solved' if r.solved else 'not solved'} (verified), score {r.score:.2f}: {r.calls} calls, "
          f"{r.expansions} expansions, {r.proposals} proposals, {r.pruned} malformed, {r.nodes} nodes")
    return 0
