"""The program mix of the scheduling benchmarks, written once as plans.

A plan is a generator that yields what the program does next and receives the result:

    Call(prompt, max_tokens)   -> the output token ids
    Parallel((Call, ...))      -> a list of output token ids, one per call (threads of the program)
    Tool(seconds, observation) -> the observation tokens, after the tool ran for `seconds`

`agentrt/bench/programs.py` drives plans on the real engine through `@agentrt.program` functions
(`agentrt.generate`, `agentrt.gather`, an `@agentrt.tool`); `agentrt/bench/simulate.py` drives the same plans
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

import math
import random
from collections.abc import Callable, Generator
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
# sharing in disguise (docs/benchmarks/programs.md, earlier runs). A ReAct loop makes 2-10 calls (uniform: BFCL-like
# tasks take a few tool calls, some many). A tree round is 16 parallel calls, LATS-like (8 sampled
# children, each with a value call), four times the engine's seats: the fan-out that makes call-level
# FCFS put every later program behind it; a search expands 3 levels. Most programs are chats, a few are
# tree searches that carry most of the work: the heavy tail of Autellix's traces, scaled down.
CHAT = {"prompt": 32, "max_tokens": 16}
REACT = {"calls": (2, 10), "prompt": 64, "max_tokens": 32, "observation": 16, "tool_s": (0.2, 0.6)}
TREE = {"width": 16, "depth": 3, "prompt": 32, "max_tokens": 32}
MIX = {"chat": 0.8, "react": 0.12, "tree": 0.08}


def describe() -> str:
    """One line for reports: the mix and the size of each of its kinds."""
    kinds = ", ".join(f"{k} {v:.0%}" for k, v in MIX.items())
    sizes = {
        "chat": f"chat = 1 call ({CHAT['prompt'] + 32} prompt / {CHAT['max_tokens']} output tokens)",
        "react": f"react = {REACT['calls'][0]}-{REACT['calls'][1]} sequential calls with "
                 f"{REACT['tool_s'][0]}-{REACT['tool_s'][1]} s tool gaps, {REACT['max_tokens']} output tokens a call",
        "tree": f"tree = root + {TREE['depth']} rounds of {TREE['width']} parallel calls + final call, "
                f"{TREE['max_tokens']} output tokens a call",
        "react_few": f"react_few = {REACT_FEW['calls'][0]}-{REACT_FEW['calls'][1]} sequential calls over a "
                     f"{REACT_FEW['task'] + 64}-token task, {REACT_FEW['observation'][0]}-{REACT_FEW['observation'][1]}-token "
                     f"observations, {REACT_FEW['max_tokens']} output tokens a call",
        "steps": f"steps = {STEPS['steps'][0]}-{STEPS['steps'][1]} steps of {STEPS['width']} parallel calls on one "
                 f"conversation from a {STEPS['task'] + 64}-token task, {STEPS['observation'][0]}-"
                 f"{STEPS['observation'][1]}-token observations, {STEPS['max_tokens']} output tokens a call",
    }
    known = [sizes[k] for k in MIX if k in sizes]
    gaps = (f"; tool gaps log-normal, median {REACT_FEW['tool_median_s']} s" if {"react_few", "steps"} & set(MIX)
            else "")
    return f"{kinds}; " + "; ".join(known) + gaps if known else kinds


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


# Agent traffic where calls wait for memory (issue 47): most programs are short ReAct loops (2-4 sequential
# calls over a growing context), about a quarter are long "step" programs that run 8-12 steps of 4 parallel
# calls on one shared, growing conversation (a planner sampling 4 candidates a step and keeping one). Contexts
# of 600 to 2,000 tokens, so an engine with a few hundred KV blocks holds a fraction of them.
# Tool gaps log-normal around 0.2 s. `--mix react_few=0.73,steps=0.27` (AGENT_WAIT_MIX).
REACT_FEW = {"calls": (2, 4), "task": 480, "max_tokens": 24, "observation": (96, 192), "tool_median_s": 0.2,
             "tool_sigma": 0.8, "tool_max_s": 3.0}
STEPS = {"steps": (8, 12), "width": 4, "task": 480, "max_tokens": 24, "observation": (48, 96), "tool_median_s": 0.2,
         "tool_sigma": 0.8, "tool_max_s": 3.0}
AGENT_WAIT_MIX = {"react_few": 0.73, "steps": 0.27}
_WAIT_PREFIX = {kind: tokens(random.Random(100 + k), 64) for k, kind in enumerate(AGENT_WAIT_MIX)}


def react_few_plan(rng: random.Random) -> Plan:
    yield from agent_plan(rng, {**REACT_FEW, "turns": REACT_FEW["calls"]}, lambda n: tokens(rng, n),
                          _WAIT_PREFIX["react_few"])


def steps_plan(rng: random.Random) -> Plan:
    history = _WAIT_PREFIX["steps"] + tokens(rng, STEPS["task"])
    steps = rng.randint(*STEPS["steps"])
    for i in range(steps):
        replies = yield Parallel(tuple(Call(history + tokens(rng, 8), STEPS["max_tokens"]) for _ in range(STEPS["width"])))
        history = history + replies[0]
        if i + 1 < steps:
            history = history + (yield Tool(tool_seconds(rng, STEPS), tokens(rng, rng.randint(*STEPS["observation"]))))


PLANS = {"chat": chat_plan, "react": react_plan, "tree": tree_plan, "react_few": react_few_plan, "steps": steps_plan}


def plan(spec: ProgramSpec) -> Plan:
    plans = PLANS if spec.kind in PLANS else AGENT_PLANS
    return plans[spec.kind](random.Random(spec.seed))


def planned_output_tokens(spec: ProgramSpec) -> int:
    """The tokens a program generates when every call runs to its max_tokens (the benchmarks ignore EOS)."""
    gen, value, total = plan(spec), None, 0
    while True:
        try:
            action = gen.send(value)
        except StopIteration:
            return total
        if isinstance(action, Call):
            total += action.max_tokens
            value = [0] * action.max_tokens
        elif isinstance(action, Parallel):
            total += sum(c.max_tokens for c in action.calls)
            value = [[0] * c.max_tokens for c in action.calls]
        else:
            value = action.observation


# ---- agents whose KV is worth keeping across tool calls (issue 14: retention) ----------------------
# A ReAct / coding agent: a system prompt shared by its kind, a task, then turns of (call, tool), the
# context growing by the call's output and the tool's observation each turn. Sources of the shapes:
# - tool latency: median ~0.1-0.6 s with a heavy tail to minutes (Continuum, arXiv 2511.02230, §2-3, on
#   SWE-bench and BFCL agent traces, as summarized in ALGORITHMS.md and issue 14): a log-normal with
#   median `tool_median_s` and shape `tool_sigma`, cut at `tool_max_s`;
# - coding agents (SWE-bench-like, Continuum §2): tens of turns, context growing by ~2k tokens a turn
#   (file contents and command output) to tens of thousands of tokens;
# - ReAct (BFCL-like, Autellix §6 / DESIGN.md §6): ~10 calls, ~735 prompt / ~34 output tokens a call.
# Sizes here are ours, chosen to match those shapes; `AGENT_SMALL` scales them to the 2-core CPU.
AGENT_SMALL = {"turns": (4, 6), "system": 32, "task": 160, "max_tokens": 16, "observation": (16, 32),
               "tool_median_s": 0.4, "tool_sigma": 1.0, "tool_max_s": 6.0}
# REACT_SMALL: REACT_FULL's shape on the 2-core CPU (~20 prompt tokens per output token per call, the context
# growing by tool observations), so that recomputing a lost context costs what it does in real agent traffic
REACT_SMALL = {"turns": (4, 6), "system": 64, "task": 480, "max_tokens": 24, "observation": (96, 192),
               "tool_median_s": 0.3, "tool_sigma": 1.0, "tool_max_s": 6.0}
CODING_FULL = {"turns": (10, 40), "system": 1000, "task": 3000, "max_tokens": 150, "observation": (1500, 2500),
               "tool_median_s": 0.5, "tool_sigma": 1.5, "tool_max_s": 120.0}
REACT_FULL = {"turns": (6, 15), "system": 500, "task": 235, "max_tokens": 34, "observation": (100, 400),
              "tool_median_s": 0.3, "tool_sigma": 1.2, "tool_max_s": 60.0}


def tool_seconds(rng: random.Random, size: dict[str, Any]) -> float:
    return min(size["tool_max_s"], rng.lognormvariate(math.log(size["tool_median_s"]), size["tool_sigma"]))


def agent_plan(rng: random.Random, size: dict[str, Any], fresh: Callable[[int], list[int]], prefix: list[int]) -> Plan:
    """Turns of (call, tool) over a growing context; `fresh(n)` makes n new token ids (the simulator's are
    cheap ranges, the real engine's random ids), `prefix` is the kind's shared system prompt."""
    turns = rng.randint(*size["turns"])
    history = prefix + fresh(size["task"])
    for i in range(turns):
        history = history + (yield Call(history, size["max_tokens"]))
        if i + 1 < turns:
            observation = fresh(rng.randint(*size["observation"]))
            history = history + (yield Tool(tool_seconds(rng, size), observation))


def _ranges(rng: random.Random) -> Callable[[int], list[int]]:
    """Fresh token ids as consecutive ranges from a random base: as unique as random ids for the prefix
    cache, at C speed (full-size contexts run to tens of thousands of tokens; simulator only)."""
    counter = [rng.randrange(1 << 20) << 24]

    def fresh(n: int) -> list[int]:
        start = counter[0]
        counter[0] += n
        return list(range(start, start + n))

    return fresh


_FULL_PREFIX = {"coding": list(range(1 << 50, (1 << 50) + CODING_FULL["system"])),
                "react_full": list(range(1 << 51, (1 << 51) + REACT_FULL["system"]))}
AGENT_PLANS = {  # full-size agents, simulator only (not in MIX / PLANS, the real benchmarks' kinds)
    "coding": lambda rng: agent_plan(rng, CODING_FULL, _ranges(rng), _FULL_PREFIX["coding"]),
    "react_full": lambda rng: agent_plan(rng, REACT_FULL, _ranges(rng), _FULL_PREFIX["react_full"]),
}
AGENT_MIX = {"coding": 0.5, "react_full": 0.5}


def make_agent_workload(n: int, rate: float, seed: int, mix: dict[str, float] = AGENT_MIX) -> list[ProgramSpec]:
    """`n` full-size agents (coding / ReAct), Poisson arrivals at `rate` programs/s."""
    rng = random.Random(seed)
    kinds, weights = zip(*mix.items())
    t, specs = 0.0, []
    for i in range(n):
        specs.append(ProgramSpec(i, rng.choices(kinds, weights)[0], t, rng.randrange(1 << 30)))
        t += rng.expovariate(rate)
    return specs
