"""Multi-turn chat: each turn resends the growing conversation, so its prefix stays cached and only
the new turn is computed.

    agentrt run programs/chat.py -- "What is the capital of France?" "And of Italy?"
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import agentrt

SYSTEM = "You are a concise assistant. Answer in one or two sentences."


@agentrt.program(name="chat")
async def chat_session(questions: list[str], max_tokens: int = 48) -> list[str]:
    messages = [{"role": "system", "content": SYSTEM}]
    answers = []
    for q in questions:
        messages.append({"role": "user", "content": q})
        reply = await agentrt.chat(messages, max_tokens=max_tokens, temperature=0)
        messages.append({"role": "assistant", "content": reply})
        answers.append(reply)
    return answers


async def main(argv: Sequence[str] = ()) -> int:
    """`agentrt run programs/chat.py [--url URL] -- QUESTION ...`: one conversation, a turn per question."""
    ap = argparse.ArgumentParser(prog="chat.py", description="a multi-turn conversation")
    ap.add_argument("questions", nargs="*", default=["What is the capital of France?", "And of Italy?"])
    ap.add_argument("--max-tokens", type=int, default=48)
    a = ap.parse_args(argv)
    for q, reply in zip(a.questions, await chat_session(a.questions, max_tokens=a.max_tokens)):
        print(f"> {q}\n{reply.strip()}\n")
    return 0
