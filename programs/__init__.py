"""Example agent programs built on agentrt's public API only: chat, ReAct, MCTS (on Countdown), and the demo."""
