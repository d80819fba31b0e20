"""ReAct: think, call a tool, observe, repeat, answer.

The model writes `Action: calculator[EXPRESSION]`; the program runs the tool and appends the
observation. A 135M model follows the format only loosely, so the loop is bounded and the tool
parses defensively; what matters here is the call pattern (LLM call, tool gap, LLM call, ...).
"""

from __future__ import annotations

import ast
import operator
import re

import anyio

import agentrt

PROMPT = """Answer the question. Use the calculator for arithmetic.
Format:
Thought: what to do
Action: calculator[2 + 3]
Observation: 5
... (repeat as needed)
Final Answer: the answer

Question: {question}
"""

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.Pow: operator.pow}


def _eval(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("unsupported expression")


@agentrt.tool
async def calculator(expression: str) -> str:
    await anyio.sleep(0.05)  # a real tool takes time; the program's KV should survive it
    try:
        return str(_eval(ast.parse(expression, mode="eval").body))
    except Exception as e:  # the model's expression is untrusted input
        return f"error: {e}"


@agentrt.program(name="react")
async def react(question: str, max_steps: int = 4, max_tokens: int = 48) -> str:
    transcript = PROMPT.format(question=question)
    for _ in range(max_steps):
        step = await agentrt.generate(transcript, max_tokens=max_tokens, temperature=0, stop=["Observation:"])
        transcript += step
        if "Final Answer:" in step:
            return step.split("Final Answer:", 1)[1].strip()
        m = re.search(r"calculator\[(.*?)\]", step)
        if m is None:
            return step.strip()
        transcript += f"\nObservation: {await calculator(m.group(1))}\n"
    return transcript.rsplit("\n", 2)[-1].strip()
