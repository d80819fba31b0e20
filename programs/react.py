"""ReAct: think, act with a tool, observe, repeat, answer.

Three tools, each an `@agentrt.tool` (the runtime times them; the program's KV cache is kept
across them):

- `calculator[EXPRESSION]` — arithmetic on numbers with + - * / // % ** and parentheses, evaluated
  by walking Python's AST (never `eval`), with limits on size and exponents;
- `search[QUERY]` — the best match in a small encyclopedia shipped in `programs/data/`;
- `weather[CITY]` — a stand-in for a remote API: answers from `programs/data/weather.json` after
  `WEATHER_LATENCY_S` of real waiting, the gap between LLM calls that KV retention is about.

The prompt shows the format with a few worked examples (a 135M model follows examples, not
instructions); `parse_reply` reads whatever the model writes (a missing bracket, another case, a
stray line) and never raises. The loop is bounded: when `max_steps - 1` calls have not reached an
answer, the last call is asked for the final answer directly.

    agentrt run programs/react.py -- "How tall is Mount Everest?"
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import anyio

import agentrt

DATA = Path(__file__).resolve().parent / "data"
WEATHER_LATENCY_S = 0.5

PROMPT = """Answer the question. You can use these tools:
calculator[expression]: does arithmetic
search[query]: finds a fact in the encyclopedia
weather[city]: the weather in a city now
Write one Action, then wait for its Observation. End with Final Answer.

Question: What is 12 times 7?
Thought: I need to multiply.
Action: calculator[12 * 7]
Observation: 84
Thought: I know the answer.
Final Answer: 84

Question: How tall is the Eiffel Tower?
Thought: I should search for it.
Action: search[Eiffel Tower]
Observation: The Eiffel Tower in Paris is 330 metres tall. It was completed in 1889.
Thought: I know the answer.
Final Answer: 330 metres

Question: What is the weather in Oslo?
Thought: I should check the weather.
Action: weather[Oslo]
Observation: Oslo: 4 C, snow
Thought: I know the answer.
Final Answer: 4 C and snow

Question: {question}
Thought:"""

STOP = ["Observation:", "\nQuestion:", "\n\n"]


# --- parsing the model's reply ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Action:
    tool: str  # one of TOOLS' names, lower case
    arg: str


@dataclass(frozen=True, slots=True)
class Answer:
    text: str


_ACTION = re.compile(r"Action\s*:\s*([A-Za-z_]+)\s*(?:[\[\(\{:]([^\]\)\}\n]*)|[ \t]+([^\n]+))", re.I)
_ANSWER = re.compile(r"Final\s*Answer\s*:\s*(.*)", re.I)


def parse_reply(text: str) -> Action | Answer | None:
    """The first Action or Final Answer in a reply, whichever comes first; None when neither is there
    or the action has no argument. An action naming no known tool (a small model invents
    `multiplication[17 * 23]`, `height[Mount Everest]`) goes to the calculator when its argument is
    arithmetic, else to search with the name and the argument as the query."""
    if not isinstance(text, str):
        return None
    act, ans = _ACTION.search(text), _ANSWER.search(text)
    if ans is not None and (act is None or ans.start() < act.start()):
        answer = ans.group(1).strip().split("\n", 1)[0].strip()
        return Answer(answer) if answer else None
    if act is None:
        return None
    name = act.group(1).lower()
    arg = (act.group(2) if act.group(2) is not None else act.group(3) or "").strip().strip("\"'")
    if not arg:
        return None
    tool = next((t for t in TOOLS if name == t or (len(name) >= 4 and (t.startswith(name) or name.startswith(t)))), None)
    if tool is None:
        try:
            safe_eval(arg)
            tool = "calculator"
        except CalcError:
            tool, arg = "search", f"{name} {arg}"
    return Action(tool, arg[:200])


# --- calculator ---------------------------------------------------------------------------------
class CalcError(ValueError):
    pass


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_ABS = 1e18


def safe_eval(expression: str) -> int | float:
    """Evaluate arithmetic without `eval`: numbers, + - * / // % **, unary minus, parentheses.
    `x`/`×` and `^` are read as * and **, and thousands separators are dropped. Raises CalcError."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalcError("empty expression")
    if len(expression) > 200:
        raise CalcError("expression too long")
    expr = re.sub(r"(?<=\d),(?=\d{3}\b)", "", expression)
    expr = expr.replace("×", "*").replace("÷", "/").replace("^", "**").replace("−", "-")
    expr = re.sub(r"(?<=[\d)\s])[xX](?=[\d(\s])", "*", expr).strip().rstrip("=").strip()
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError):
        raise CalcError(f"not arithmetic: {expression!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)  # a literal too: "1e100" is as out of range as 10 ** 100
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise CalcError("exponent too large")
        try:
            value = _BINOPS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        return _bounded(value)
    raise CalcError(f"not arithmetic: {ast.dump(node)[:60]}")


def _bounded(value: int | float | complex) -> int | float:
    if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)) or abs(value) > _MAX_ABS:
        raise CalcError("result out of range")
    return value


def format_number(v: int | float) -> str:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return str(v) if isinstance(v, int) else f"{v:.6g}"


# --- search -------------------------------------------------------------------------------------
_STOPWORDS = frozenset("a an the of in on at to is are was were how what which who when where why many much "
                       "does do did it its and or for from by with as be long tall big far old".split())


def _terms(text: str) -> list[str]:
    return [w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in _STOPWORDS]


@cache
def documents() -> tuple[tuple[str, str], ...]:
    """(title, text) of every document in programs/data/encyclopedia.jsonl."""
    with open(DATA / "encyclopedia.jsonl", encoding="utf-8") as f:
        return tuple((d["title"], d["text"]) for d in map(json.loads, filter(str.strip, f)))


def search_docs(query: str, docs: Sequence[tuple[str, str]] | None = None) -> tuple[str, str] | None:
    """The document whose words best match the query's (rarer words weigh more; title words count
    double); None when no word matches."""
    docs = documents() if docs is None else docs
    q = set(_terms(query if isinstance(query, str) else ""))
    if not q:
        return None
    df: dict[str, int] = {}
    bags = []
    for title, text in docs:
        bag = _terms(title) * 2 + _terms(text)
        bags.append(bag)
        for w in set(bag):
            df[w] = df.get(w, 0) + 1
    best, best_score = None, 0.0
    for doc, bag in zip(docs, bags):
        score = sum(math.log(1 + len(docs) / df[w]) * min(2, bag.count(w)) for w in q if w in df and w in bag)
        if score > best_score:
            best, best_score = doc, score
    return best


# --- tools --------------------------------------------------------------------------------------
@agentrt.tool
async def calculator(expression: str) -> str:
    try:
        return format_number(safe_eval(expression))
    except CalcError as e:
        return f"error: {e}"


@agentrt.tool
async def search(query: str) -> str:
    doc = search_docs(query)
    return doc[1] if doc is not None else f"no document matches {query[:60]!r}"


@agentrt.tool
async def weather(city: str) -> str:
    await anyio.sleep(WEATHER_LATENCY_S)  # a remote service's round trip
    table = json.loads((DATA / "weather.json").read_text())
    name = city.strip().strip(".?!").lower()
    return f"{city.strip()}: {table[name]}" if name in table else f"no weather report for {city[:40]!r}"


TOOLS = {"calculator": calculator, "search": search, "weather": weather}


# --- the program --------------------------------------------------------------------------------
@dataclass
class ReActResult:
    question: str
    answer: str
    steps: int  # LLM calls
    tool_calls: list[tuple[str, str, str]] = field(default_factory=list)  # (tool, argument, observation)
    forced: bool = False  # the step limit was reached and the answer was asked for directly


@agentrt.program(name="react")
async def react(question: str, max_steps: int = 5, max_tokens: int = 40) -> ReActResult:
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    transcript = PROMPT.format(question=question)
    result = ReActResult(question, "", 0)
    for step in range(max_steps):
        last = step == max_steps - 1
        if last:
            transcript += " I know the answer.\nFinal Answer:"
        reply = await agentrt.generate(transcript, max_tokens=max_tokens, temperature=0, stop=STOP)
        result.steps += 1
        if last:
            result.answer, result.forced = reply.strip().split("\n", 1)[0].strip(), True
            return result
        parsed = parse_reply(reply)
        if isinstance(parsed, Answer):
            result.answer = parsed.text
            return result
        if isinstance(parsed, Action):
            observation = (await TOOLS[parsed.tool](parsed.arg))[:300]
            result.tool_calls.append((parsed.tool, parsed.arg, observation))
            transcript += f" {_thought(reply)}\nAction: {parsed.tool}[{parsed.arg}]\nObservation: {observation}\nThought:"
        else:
            transcript += (f" {_thought(reply)}\nObservation: write Action: calculator[...], search[...] or "
                           "weather[...], or Final Answer: ...\nThought:")
    return result


def _thought(reply: str) -> str:
    """The reply's first line (its thought), without any action written on it."""
    first = reply.strip().split("\n", 1)[0]
    return first.split("Action", 1)[0].strip() or "I should use a tool."


async def main(argv: Sequence[str] = ()) -> int:
    """`agentrt run programs/react.py [--url URL] -- QUESTION`."""
    ap = argparse.ArgumentParser(prog="react.py", description="ReAct with a calculator, search and weather")
    ap.add_argument("question", nargs="*", default=["How tall is Mount Everest?"])
    ap.add_argument("--max-steps", type=int, default=5)
    a = ap.parse_args(argv)
    r = await react(" ".join(a.question), max_steps=a.max_steps)
    for tool, arg, obs in r.tool_calls:
        print(f"  {tool}[{arg}] -> {obs}")
    print(f"{r.question}\n{r.answer or '(no answer)'}")
    print(f"{r.steps} LLM calls, {len(r.tool_calls)} tool calls{', answer forced at the step limit' if r.forced else ''}")
    return 0
