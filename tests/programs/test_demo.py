"""`agentrt demo`: the mix of MCTS, ReAct and chat programs with its table and summary, in-process and
against a server (a live one in this process, or `agentrt serve` started as a child process)."""

from __future__ import annotations

import pytest

from agentrt.programs.demo import main as demo
from tests.server.live import live_server, tiny_config

SMALL = ["--mcts", "1", "--react", "1", "--chat", "1", "--budget", "4", "--max-steps", "3", "--chat-tokens", "12",
         "--no-live"]


def test_demo_starts_a_server_and_stops_it(tiny_model_path, capfd):
    assert demo(["--model", str(tiny_model_path), *SMALL]) == 0
    out, err = capfd.readouterr()
    assert "summary" in out and "3 programs" in out and "through http://127.0.0.1:" in out
    assert "/ui" in err and "server stopped (exit code 0)" in err


@pytest.mark.slow
def test_demo_in_process(default_model_path, capsys):
    assert demo(["--in-process", "--model", str(default_model_path), *SMALL]) == 0
    out = capsys.readouterr().out
    assert "summary" in out and "3 programs" in out and "(verified)" in out and "KV in use" in out
    for name in ("mcts", "react", "chat"):
        assert name in out


@pytest.mark.slow
def test_demo_against_a_server(default_model_path, capsys):
    with live_server(tiny_config(default_model_path, engine={"num_blocks": 512})) as s:
        assert demo(["--url", s.url, *SMALL]) == 0
        programs = list(s.state.runtime.programs)
    out = capsys.readouterr().out
    assert "summary" in out and f"through {s.url}" in out and "(verified)" in out
    assert [p.state for p in programs] == ["finished"] * 3
    assert max(p.num_threads for p in programs) >= 2  # MCTS: threads of one program on the server
