"""Benchmarks: scripts that print measurements (`agentrt bench NAME`), never timed tests."""
