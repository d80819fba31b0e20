"""Example agent programs built on agentrt's public API only: chat, ReAct, tree search."""
