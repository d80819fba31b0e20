"""Countdown, the task `mcts.py` and `bench countdown` solve: reach a target from given numbers with
+ - * /, each number used at most once, every intermediate result a positive integer.

The model writes steps such as `4 * 7 = 28`; `parse_step` reads the operands and the operator only
and the verifier recomputes the result, so a step is valid when its operands are still available
and the operation is exact (no negative or fractional results). Anything else is malformed: the
parsers return None, never raise, whatever the text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Puzzle:
    numbers: tuple[int, ...]
    target: int

    def __str__(self) -> str:
        return f"Numbers: {' '.join(map(str, self.numbers))}. Target: {self.target}."


@dataclass(frozen=True, slots=True)
class Step:
    a: int
    op: str  # one of + - * /
    b: int
    result: int
    left: tuple[int, ...]  # the numbers available after this step

    def __str__(self) -> str:
        return f"{self.a} {self.op} {self.b} = {self.result}. Left: {' '.join(map(str, self.left))}."


# 20 puzzles of three numbers in 2..12 whose target needs two operations (none is reachable in one),
# drawn once with random.Random(15); the benchmark's fixed set.
PUZZLES: tuple[Puzzle, ...] = tuple(Puzzle(n, t) for n, t in [
    ((2, 5, 10), 17), ((2, 4, 5), 11), ((4, 7, 12), 41), ((3, 7, 9), 42), ((6, 7, 8), 55),
    ((5, 7, 11), 13), ((5, 6, 7), 47), ((5, 8, 9), 27), ((3, 9, 12), 63), ((7, 9, 11), 92),
    ((3, 8, 9), 20), ((4, 5, 10), 30), ((2, 6, 11), 14), ((3, 4, 9), 63), ((2, 3, 8), 26),
    ((6, 8, 10), 74), ((4, 5, 10), 54), ((3, 5, 7), 16), ((4, 6, 7), 14), ((7, 9, 12), 75),
])

FEW_SHOT = """Combine the numbers with + - * / to reach the target. Use each number once.

Numbers: 3 5 6. Target: 21.
3 * 5 = 15. Left: 6 15.
15 + 6 = 21. Left: 21. Done.

Numbers: 4 9 6. Target: 30.
9 - 4 = 5. Left: 6 5.
6 * 5 = 30. Left: 30. Done.

Numbers: 8 2 7. Target: 17.
8 + 2 = 10. Left: 7 10.
10 + 7 = 17. Left: 17. Done.

Numbers: 2 3 12. Target: 18.
12 / 2 = 6. Left: 3 6.
3 * 6 = 18. Left: 18. Done.

"""

_OPS = {"+": "+", "-": "-", "\u2212": "-", "*": "*", "x": "*", "X": "*", "\u00d7": "*", "/": "/", "\u00f7": "/"}
_STEP = re.compile(r"(\d{1,9})\s*([-+*/xX\u2212\u00d7\u00f7])\s*(\d{1,9})")


def apply_op(a: int, op: str, b: int) -> int | None:
    """The result, or None when it is not a positive integer."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b if a > b else None
    if op == "*":
        return a * b
    if op == "/":
        return a // b if b > 0 and a % b == 0 else None
    return None


def parse_step(text: str, left: Sequence[int]) -> Step | None:
    """The first `a op b` in the first line of `text`, checked against the numbers `left`; None
    when there is none, an operand is not available, or the operation is not exact."""
    if not isinstance(text, str):
        return None
    line = text.strip().split("\n", 1)[0]
    m = _STEP.search(line)
    if m is None:
        return None
    a, op, b = int(m.group(1)), _OPS[m.group(2)], int(m.group(3))
    pool = list(left)
    for x in (a, b):
        if x not in pool:
            return None
        pool.remove(x)
    result = apply_op(a, op, b)
    if result is None:
        return None
    return Step(a, op, b, result, (*pool, result))


def parse_solution(text: str, puzzle: Puzzle) -> list[Step]:
    """The valid steps at the start of a written solution (up to the first blank line); parsing
    stops at the first malformed line or once the target is reached."""
    steps: list[Step] = []
    left: tuple[int, ...] = puzzle.numbers
    for line in (text if isinstance(text, str) else "").strip().split("\n"):
        if not line.strip():
            break
        step = parse_step(line, left)
        if step is None:
            break
        steps.append(step)
        left = step.left
        if puzzle.target in left:
            break
    return steps


def verify(puzzle: Puzzle, steps: Sequence[Step]) -> bool:
    """True when the steps are valid from the puzzle's numbers and one of them produces the target."""
    left: tuple[int, ...] = puzzle.numbers
    for s in steps:
        step = parse_step(f"{s.a} {s.op} {s.b}", left)
        if step is None:
            return False
        left = step.left
        if step.result == puzzle.target:
            return True
    return False


def closeness(left: Sequence[int], target: int) -> float:
    """How near the nearest available number is to the target, in [0, 1]; 1 when it is the target."""
    return max((max(0.0, 1.0 - abs(n - target) / target) for n in left), default=0.0)


def prompt(puzzle: Puzzle, steps: Sequence[Step] = ()) -> str:
    """The few-shot prompt, the puzzle, and the steps so far: the model continues with the next step."""
    return FEW_SHOT + str(puzzle) + "\n" + "".join(f"{s}\n" for s in steps)


def render(steps: Sequence[Step]) -> str:
    return "\n".join(str(s) for s in steps)
