"""The example programs' parsers, verifier, calculator, search and tree bookkeeping, on well-formed
input and on garbage (no model): whatever the model writes, nothing raises."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrt.programs.countdown import PUZZLES, Puzzle, Step, closeness, parse_solution, parse_step, prompt, verify
from agentrt.programs.mcts import Node, backpropagate, children_from, select
from agentrt.programs.react import Action, Answer, CalcError, documents, parse_reply, safe_eval, search_docs

garbage = st.one_of(st.text(max_size=300), st.text(alphabet="0123456789+-*/xX=. \n()[]:LeftDone", max_size=80))


# --- Countdown ------------------------------------------------------------------------------------
def test_parse_step_reads_operands_and_recomputes():
    s = parse_step("4 * 7 = 29. Left: 29 2.", (4, 7, 2))  # the model's arithmetic slip is corrected
    assert s == Step(4, "*", 7, 28, (2, 28))
    assert parse_step("12 / 4", (4, 12)) == Step(12, "/", 4, 3, (3,))
    assert parse_step("9 x 3", (3, 9)).result == 27
    assert parse_step("9 − 3", (3, 9)).result == 6  # unicode minus


@pytest.mark.parametrize("text", [
    "", "hello", "5 + 5", "2 - 7", "7 / 2", "7 / 0", "3 ** 2", "4^2", "4 * 4", "99999999999 * 2", "4*",
])
def test_parse_step_rejects_malformed(text):
    assert parse_step(text, (4, 7, 2)) is None


def test_solution_and_verifier():
    p = Puzzle((4, 7, 12), 41)
    steps = parse_solution("4 * 12 = 48. Left: 7 48.\n48 - 7 = 41. Left: 41. Done.\nnonsense", p)
    assert [s.result for s in steps] == [48, 41] and verify(p, steps)
    assert not verify(p, steps[:1])
    assert parse_solution("4 * 12 = 48.\n48 - 9 = 39.", p)[-1].result == 48  # 9 is not available: stops
    forged = [Step(4, "*", 12, 48, (7, 48)), Step(48, "-", 7, 41, (41,)), Step(41, "+", 0, 41, ())]
    assert verify(p, forged)  # reaches the target before the bogus third step
    assert not verify(p, [Step(5, "*", 8, 40, ()), Step(40, "+", 1, 41, ())])  # operands never available


def test_puzzles_are_solvable_and_fixed():
    assert len(PUZZLES) == 20
    for p in PUZZLES:
        assert p.target not in p.numbers
        assert any(_solves(p, p.numbers)), p


def _solves(p: Puzzle, left: tuple[int, ...]):
    for i, a in enumerate(left):
        for j, b in enumerate(left):
            if i != j:
                for op in "+-*/":
                    s = parse_step(f"{a} {op} {b}", left)
                    if s is not None:
                        yield s.result == p.target or any(_solves(p, s.left))


@settings(max_examples=300, deadline=None)
@given(garbage, st.lists(st.integers(0, 20), max_size=4))
def test_countdown_parsers_never_raise(text, numbers):
    step = parse_step(text, numbers)
    assert step is None or step.result > 0
    steps = parse_solution(text, Puzzle(tuple(numbers), 24))
    verify(Puzzle(tuple(numbers), 24), steps)
    assert 0.0 <= closeness(numbers, 24) <= 1.0


# --- MCTS bookkeeping -------------------------------------------------------------------------------
def test_malformed_proposals_prune_and_duplicates_merge():
    root = Node((), (4, 7, 12))
    children, pruned = children_from(root, ["4 * 12 = 48", "12 * 4 = 48", "4 - 12", "garbage", "", "12 - 4 = 8"], 41)
    assert pruned == 3  # 4 - 12 (negative), garbage, empty
    assert [c.steps[-1].result for c in children] == [48, 8]  # 12 * 4 merged into 4 * 12
    assert all(c.parent is root and not c.solved for c in children)
    win = children_from(children[0], ["48 - 7"], 41)[0][0]
    assert win.solved and win.score == 1.0 and win.exhausted  # terminal


def test_select_backprop_and_exhaustion():
    root = Node((), (2, 3, 4))
    assert select(root, 1.0, max_expansions=2) is root
    root.expansions = 1
    root.children, _ = children_from(root, ["2 + 3", "3 * 4"], 20)
    for c in root.children:
        backpropagate(c, c.score)
    assert root.visits == 2 and math.isclose(root.value_sum, sum(c.score for c in root.children))
    best = max(root.children, key=lambda c: c.score)
    assert select(root, 0.0, 2) is best  # no exploration: the better child
    for c in root.children:
        c.exhausted = True
    assert select(root, 1.0, 2) is root  # all children done: expand the root again
    root.expansions = 2
    assert select(root, 1.0, 2) is None and root.exhausted  # nothing left


# --- ReAct ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    (" I need to multiply.\nAction: calculator[17 * 23]\n", Action("calculator", "17 * 23")),
    ("Action: Calculator(3+4) and more", Action("calculator", "3+4")),
    ("action: search Eiffel Tower", Action("search", "Eiffel Tower")),
    ("Action: weather: Oslo", Action("weather", "Oslo")),
    ("Action: calc[2^10", Action("calculator", "2^10")),
    ("Thought: easy.\nFinal Answer: 391\nAction: search[x]", Answer("391")),
    ("final answer:  42 metres \nmore", Answer("42 metres")),
    ("Action: multiplication[17 * 23]", Action("calculator", "17 * 23")),  # invented tools: read the intent
    ("Action: height[Mount Everest]", Action("search", "height Mount Everest")),
    ("Action: search[]", None), ("Final Answer:", None), ("", None),
    ("Thought: hmm", None),
])
def test_parse_reply(text, expected):
    assert parse_reply(text) == expected


@settings(max_examples=300, deadline=None)
@given(garbage)
def test_parse_reply_never_raises(text):
    r = parse_reply(text)
    assert r is None or isinstance(r, (Action, Answer))
    if isinstance(r, Action):
        assert r.tool in ("calculator", "search", "weather") and r.arg and len(r.arg) <= 200


@pytest.mark.parametrize("expr, value", [
    ("17 * 23", 391), ("2^10", 1024), ("1,000 x 3", 3000), ("10/4", 2.5), ("(2+3)*4=", 20), ("3 × 4", 12),
    ("-5 + 2.5", -2.5), ("7 // 2", 3), ("7 % 4", 3),
])
def test_calculator(expr, value):
    assert safe_eval(expr) == value


@pytest.mark.parametrize("expr", [
    "__import__('os').system('true')", "open('/etc/passwd')", "(1).__class__", "[1, 2]", "lambda: 1", "x + 1",
    "9 ** 9 ** 9", "10 ** 100 * 10 ** 100", "1 / 0", "", "1" * 300, "2 +", "'a' * 3", "1e308 * 10", "f'{1}'",
    "1e100", "-1e100", "9" * 30, "1e999",  # out-of-range literals, not only results (found by the property below)
])
def test_calculator_refuses_anything_but_bounded_arithmetic(expr):
    with pytest.raises(CalcError):
        safe_eval(expr)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=120))
def test_calculator_raises_only_calc_error(expr):
    try:
        v = safe_eval(expr)
    except CalcError:
        return
    assert isinstance(v, (int, float)) and abs(v) <= 1e18


def test_search_finds_the_document():
    assert len(documents()) >= 20
    assert search_docs("How tall is Mount Everest?")[0] == "Mount Everest"
    assert search_docs("how many legs does a spider have")[0] == "Spider"
    assert search_docs("capital of Japan")[0] == "Tokyo"
    assert search_docs("zzz qqq") is None and search_docs("") is None


def test_prompt_ends_where_the_model_continues():
    assert prompt(PUZZLES[0]).endswith("Numbers: 2 5 10. Target: 17.\n")
