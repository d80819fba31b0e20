"""The program mix of the scheduling benchmarks, written once as plans.

A plan is a generator that yields what the program does next and receives the result:

    Call(prompt, max_tokens)   -> the output token ids
    Parallel((Call, ...))      -> a list of output token ids, one per call (threads of the program)
    Tool(seconds, observation) -> the observation tokens, after the tool ran for `seconds`

`bench/programs.py` drives plans on the real engine through `@agentrt.program` functions
(`agentrt.generate`, `agentrt.gather`, an `@agentrt.tool`); `bench/simulate.py` drives the same plans
against the engine's scheduler and KV-cache manager in virtual time. The kinds follow Autellix's
evaluation (DESIGN.md §6), scaled down for a 2-core CPU:

- chat: one call (ShareGPT-like);
- react: sequential calls whose prompt grows with each reply and observation, a tool gap between calls
  (BFCL-like); the number of calls varies per program;
- tree: a root call, rounds of parallel branch calls, a final call (LATS/MCTS-like).

Prompts are token ids from a seeded RNG with a system prefix shared by each kind (so the prefix cache
behaves as with real agents).
"""

from __future__ import annotations

import random
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

VOCAB = (1000, 40000)  # token ids drawn from here: ordinary BPE pieces of the default tokenizer


@dataclass(frozen=True, slots=True)
class Call:
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Parallel:
    calls: tuple[Call, ...]


@dataclass(frozen=True, slots=True)
class Tool:
    seconds: float
    observation: list[int]


Plan = Generator[Call | Parallel | Tool, Any, None]

# Sizes. Agent steps (a ReAct thought + action, a tree node) generate 32 tokens (real ones run 50-200);
# with 8-token steps no call holds a seat long enough to block anyone and every policy is processor
# sharing in disguise (docs/benchmarks.md, earlier runs). A ReAct loop makes 2-10 calls (uniform: BFCL-like
# tasks take a few tool calls, some many). A tree round is 16 parallel calls, LATS-like (8 sampled
# children, each with a value call), four times the engine's seats: the fan-out that makes call-level
# FCFS put every later program behind it; a search expands 3 levels. Most programs are chats, a few are
# tree searches that carry most of the work: the heavy tail of Autellix's traces, scaled down.
CHAT = {"prompt": 32, "max_tokens": 16}
REACT = {"calls": (2, 10), "prompt": 64, "max_tokens": 32, "observation": 16, "tool_s": (0.2, 0.6)}
TREE = {"width": 16, "depth": 3, "prompt": 32, "max_tokens": 32}
MIX = {"chat": 0.8, "react": 0.12, "tree": 0.08}


def describe() -> str:
    """One line for reports: the mix and the size of each kind."""
    kinds = ", ".join(f"{k} {v:.0%}" for k, v in MIX.items())
    return (
        f"{kinds}; chat = 1 call ({CHAT['prompt'] + 32} prompt / {CHAT['max_tokens']} output tokens), "
        f"react = {REACT['calls'][0]}-{REACT['calls'][1]} sequential calls with {REACT['tool_s'][0]}-{REACT['tool_s'][1]} s "
        "tool gaps, "
        f"tree = root + {TREE['depth']} rounds of {TREE['width']} parallel calls + final call, "
        f"{REACT['max_tokens']} output tokens per ReAct / tree call"
    )


@dataclass(frozen=True, slots=True)
class ProgramSpec:
    index: int
    kind: str
    arrival_s: float  # offset from the start of the run
    seed: int


def make_workload(n: int, rate: float, seed: int) -> list[ProgramSpec]:
    """`n` programs of the mix, Poisson arrivals at `rate` programs/s."""
    rng = random.Random(seed)
    kinds, weights = zip(*MIX.items())
    t, specs = 0.0, []
    for i in range(n):
        specs.append(ProgramSpec(i, rng.choices(kinds, weights)[0], t, rng.randrange(1 << 30)))
        t += rng.expovariate(rate)
    return specs


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


_PREFIX = {kind: tokens(random.Random(k), 32) for k, kind in enumerate(MIX)}  # shared system prompt per kind


def chat_plan(rng: random.Random) -> Plan:
    yield Call(_PREFIX["chat"] + tokens(rng, CHAT["prompt"]), CHAT["max_tokens"])


def react_plan(rng: random.Random) -> Plan:
    calls = rng.randint(*REACT["calls"])
    history = _PREFIX["react"] + tokens(rng, REACT["prompt"])
    for i in range(calls):
        history = history + (yield Call(history, REACT["max_tokens"]))
        if i + 1 < calls:
            history = history + (yield Tool(rng.uniform(*REACT["tool_s"]), tokens(rng, REACT["observation"])))


def tree_plan(rng: random.Random) -> Plan:
    root = _PREFIX["tree"] + tokens(rng, TREE["prompt"])
    path = root + (yield Call(root, TREE["max_tokens"]))
    for _ in range(TREE["depth"]):  # expand: one parallel call per child, follow the longest reply
        children = yield Parallel(tuple(Call(path + tokens(rng, 8), TREE["max_tokens"]) for _ in range(TREE["width"])))
        path = path + max(children, key=len)
    yield Call(path, TREE["max_tokens"])


PLANS = {"chat": chat_plan, "react": react_plan, "tree": tree_plan}


def plan(spec: ProgramSpec) -> Plan:
    return PLANS[spec.kind](random.Random(spec.seed))
