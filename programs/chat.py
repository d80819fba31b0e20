"""Multi-turn chat: each turn resends the growing conversation (its prefix stays cached)."""

from __future__ import annotations

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
